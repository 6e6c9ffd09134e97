"""KV handoff between a prefill and a decode process: real Mooncake over TCP, slot rows land intact."""

import json
import multiprocessing as mp
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
import torch

from sglite.srt.disaggregation.base import (
    KVBufferSpec,
    KVPoll,
    PDRank,
    TransferError,
    buffer_specs_from_tensors,
    coalesce_slot_runs,
    plan_copies,
    prefill_peer_rank,
)
from sglite.srt.disaggregation.bootstrap_server import BootstrapServer
from sglite.srt.disaggregation.kv_manager import DecodeKVManager, PrefillKVManager
from sglite.srt.disaggregation.transfer_backend import FakeTransferBackend, create_transfer_backend
from sglite.testing.mooncake import needs_mooncake

SUITE = "unit-cpu"
EST_TIME = 30

# Only the tests that move data through Mooncake need it (and Debian's libibverbs1, librdmacm1).
requires_mooncake = needs_mooncake()

SLOTS = 64
# Two "pools": target K/V for 2 layers (4 heads x 8) and draft K/V for 1 layer (2 heads x 16, fp16).
SHAPES = [("target.k.0", (SLOTS, 4, 8), torch.float32), ("target.v.0", (SLOTS, 4, 8), torch.float32),
          ("target.k.1", (SLOTS, 4, 8), torch.float32), ("target.v.1", (SLOTS, 4, 8), torch.float32),
          ("draft.k.0", (SLOTS, 2, 16), torch.float16), ("draft.v.0", (SLOTS, 2, 16), torch.float16)]
SRC_SLOTS = [3, 4, 5, 9, 10, 40]
DST_SLOTS = [20, 21, 22, 23, 7, 8]


def _buffers(fill: bool):
    g = torch.Generator().manual_seed(0)
    out = []
    for name, shape, dtype in SHAPES:
        t = torch.randn(shape, generator=g).to(dtype) if fill else torch.zeros(shape, dtype=dtype)
        out.append((name, t))
    return out


def _prefill_proc(port: int, ready, go, send_kv: bool):
    torch.set_num_threads(1)
    server = BootstrapServer("127.0.0.1", port)
    tensors = _buffers(fill=True)
    mgr = PrefillKVManager(create_transfer_backend("mooncake"), buffer_specs_from_tensors(tensors),
                           bootstrap_url=f"http://127.0.0.1:{server.port}", timeout_s=30)
    ready.set()
    go.wait(30)
    if send_kv:
        mgr.send(room=7, src_slots=SRC_SLOTS, first_token=123, meta={"cached_tokens": 0})
        deadline = time.time() + 20
        while mgr.poll(7) not in (KVPoll.Success, KVPoll.Failed) and time.time() < deadline:
            time.sleep(0.02)
    time.sleep(60)  # stay alive until the parent ends the test


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_prefill(send_kv: bool):
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    port = _free_port()
    p = ctx.Process(target=_prefill_proc, args=(port, ready, go, send_kv), daemon=True)
    p.start()
    assert ready.wait(60), "prefill process did not start"
    return p, port, go


def _wait(mgr, room, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = mgr.poll(room)
        if st in (KVPoll.Success, KVPoll.Failed):
            return st
        time.sleep(0.05)
    return mgr.poll(room)


def test_coalesce_runs_consecutive_on_both_sides():
    assert coalesce_slot_runs(SRC_SLOTS, DST_SLOTS) == [(3, 20, 3), (9, 23, 1), (10, 7, 1), (40, 8, 1)]
    assert coalesce_slot_runs([], []) == []
    with pytest.raises(ValueError):
        coalesce_slot_runs([1, 2], [1])


def test_plan_copies_rejects_mismatched_pools():
    a = [KVBufferSpec("target.k.0", 1000, 640, 10)]
    b = [KVBufferSpec("target.k.0", 5000, 640, 20)]
    with pytest.raises(TransferError, match="B/slot"):
        plan_copies(a, b, [1], [2])
    with pytest.raises(TransferError, match="buffers differ"):
        plan_copies(a, [KVBufferSpec("draft.k.0", 5000, 640, 10)], [1], [2])
    with pytest.raises(TransferError, match="out of range"):
        plan_copies(a, [KVBufferSpec("target.k.0", 5000, 640, 10)], [1], [64])
    src, dst, n = plan_copies(a, [KVBufferSpec("target.k.0", 5000, 640, 10)], [1, 2], [5, 6])
    assert (src, dst, n) == ([1010], [5050], [20])


@pytest.mark.timeout(120)
@requires_mooncake
def test_mooncake_moves_target_and_draft_rows():
    p, port, go = _start_prefill(send_kv=True)
    try:
        dst_tensors = _buffers(fill=False)
        mgr = DecodeKVManager(create_transfer_backend("mooncake"), buffer_specs_from_tensors(dst_tensors), timeout_s=30)
        mgr.start(room=7, bootstrap_host="127.0.0.1", bootstrap_port=port, dst_slots=DST_SLOTS)
        go.set()
        assert _wait(mgr, 7) == KVPoll.Success, mgr.error(7)
        first, meta = mgr.result(7)
        assert first == 123 and meta == {"cached_tokens": 0}
        src_tensors = _buffers(fill=True)
        for (name, src), (_, dst) in zip(src_tensors, dst_tensors):
            assert torch.equal(dst[DST_SLOTS], src[SRC_SLOTS]), name
            untouched = [i for i in range(SLOTS) if i not in DST_SLOTS]
            assert not dst[untouched].any(), f"{name}: rows outside the room were written"
        mgr.close()
    finally:
        p.kill()


@pytest.mark.timeout(120)
@requires_mooncake
def test_decode_fails_room_when_prefill_dies():
    p, port, go = _start_prefill(send_kv=False)
    dst_tensors = _buffers(fill=False)
    mgr = DecodeKVManager(create_transfer_backend("mooncake"), buffer_specs_from_tensors(dst_tensors), timeout_s=60)
    mgr.start(room=9, bootstrap_host="127.0.0.1", bootstrap_port=port, dst_slots=DST_SLOTS)
    go.set()
    time.sleep(0.5)
    assert mgr.poll(9) == KVPoll.Transferring
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    t0 = time.time()
    assert _wait(mgr, 9, timeout=20) == KVPoll.Failed
    assert time.time() - t0 < 15, "a dead prefill node must fail the room well before the 60 s timeout"
    assert "stopped answering" in mgr.error(9)
    mgr.close()


def test_decode_times_out_room_and_unreachable_bootstrap_fails_at_once():
    server = BootstrapServer("127.0.0.1", 0)
    tensors = _buffers(fill=True)
    PrefillKVManager(FakeTransferBackend(), buffer_specs_from_tensors(tensors),
                     f"http://127.0.0.1:{server.port}", timeout_s=30)
    mgr = DecodeKVManager(FakeTransferBackend(), buffer_specs_from_tensors(_buffers(False)), timeout_s=0.5)
    mgr.start(room=1, bootstrap_host="127.0.0.1", bootstrap_port=server.port, dst_slots=DST_SLOTS)
    assert _wait(mgr, 1, timeout=5) == KVPoll.Failed
    assert "did not arrive" in mgr.error(1)
    mgr.start(room=2, bootstrap_host="127.0.0.1", bootstrap_port=_free_port(), dst_slots=DST_SLOTS)
    assert mgr.poll(2) == KVPoll.Failed and "bootstrap server" in mgr.error(2)
    server.close()


def test_fake_backend_completes_control_flow_without_moving_data():
    server = BootstrapServer("127.0.0.1", 0)
    src = _buffers(fill=True)
    pre = PrefillKVManager(FakeTransferBackend(), buffer_specs_from_tensors(src),
                           f"http://127.0.0.1:{server.port}", timeout_s=30)
    dst = _buffers(fill=False)
    dec = DecodeKVManager(FakeTransferBackend(), buffer_specs_from_tensors(dst), timeout_s=30)
    dec.start(room=5, bootstrap_host="127.0.0.1", bootstrap_port=server.port, dst_slots=DST_SLOTS)
    pre.send(5, SRC_SLOTS, first_token=11, meta={})
    assert _wait(dec, 5, timeout=10) == KVPoll.Success
    assert dec.result(5)[0] == 11
    assert _wait(pre, 5, timeout=5) == KVPoll.Success
    assert all(not t.any() for _, t in dst), "the fake backend must not move data"
    pre.close(); dec.close(); server.close()


@pytest.mark.timeout(60)
def test_close_while_the_receive_loop_polls_does_not_crash():
    """close() used to close the PULL socket under the receive loop's zmq poll: a libzmq segfault
    within ~3-250 open/close cycles (it killed test_pd_scheduler under load). The loop now ends first."""
    specs = buffer_specs_from_tensors(_buffers(False))
    for i in range(30):
        mgr = DecodeKVManager(FakeTransferBackend(), specs, timeout_s=5)
        time.sleep(0.0005 * (i % 9))  # close at varying points of the 200 ms poll
        mgr.close()
        assert not any(t.is_alive() for t in mgr._threads)


def test_a_room_pairs_with_the_prefill_group_that_serves_it():
    """Prefill ranks register their place; a decode rank gets the rank of group room % groups at its own place."""
    server = BootstrapServer("127.0.0.1", 0)
    managers = [
        PrefillKVManager(FakeTransferBackend(), buffer_specs_from_tensors(_buffers(fill=True)),
                         f"http://127.0.0.1:{server.port}", timeout_s=30,
                         rank=PDRank(dp_rank=d, rank_in_group=r, group_width=2, num_groups=2))
        for d in range(2) for r in range(2)
    ]
    base = f"http://127.0.0.1:{server.port}/route"
    for room, place, want in ((5, 0, 2), (5, 1, 3), (8, 0, 0), (8, 1, 1)):
        got = json.loads(urllib.request.urlopen(f"{base}?room={room}&rank_in_group={place}").read())
        assert got["engine_rank"] == want
    with pytest.raises(urllib.error.HTTPError) as e:  # a place the prefill groups do not have
        urllib.request.urlopen(f"{base}?room=5&rank_in_group=2")
    assert e.value.code == 400 and "same attention-TP width" in e.value.read().decode()
    assert prefill_peer_rank(9, 0, prefill_group_width=1, prefill_num_groups=1) == 0
    for m in managers:
        m.close()
    server.close()
