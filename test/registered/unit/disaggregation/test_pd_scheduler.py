"""PD scheduler hooks: a prefill scheduler and a decode scheduler in one process, real bootstrap server
and ZMQ handshake, model-free workers.

The fake worker's next token is a hash of the (token, position) pairs it reads back from its KV pool
through req_to_token, so the decode node only reproduces ``reference_generate`` (the same hash over a
plain list) if the prefill node's KV rows landed exactly at the decode node's pre-allocated slots.
KV moves with an in-process memcpy backend (same pointer contract as Mooncake); the control-flow
tests use the fake backend, which moves nothing.
"""

import ctypes
import socket
import time

import pytest
import torch

from sglite.srt.disaggregation.base import buffer_specs_from_tensors
from sglite.srt.disaggregation.bootstrap_server import BootstrapServer
from sglite.srt.disaggregation.decode import DecodePrealloc
from sglite.srt.disaggregation.kv_manager import DecodeKVManager, PrefillKVManager
from sglite.srt.disaggregation.prefill import PrefillHandoff
from sglite.srt.disaggregation.transfer_backend import FakeTransferBackend, TransferBackend
from sglite.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglite.srt.managers.scheduler import Scheduler
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs
from sglite.testing.fake_model_worker import FakeModelWorker, reference_generate

SUITE = "unit-cpu"
EST_TIME = 20

pytestmark = pytest.mark.timeout(120)

VOCAB = 64
EOS = 3


class MemcpyBackend(TransferBackend):
    """Copies between buffers of the same process by address: Mooncake's write contract without a network."""

    name = "memcpy"

    def register(self, buffers):
        return None

    def session_id(self) -> str:
        return "local"

    def write(self, peer_session, src_ptrs, dst_ptrs, lengths):
        for s, d, n in zip(src_ptrs, dst_ptrs, lengths):
            ctypes.memmove(d, s, n)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _specs(w):
    return buffer_specs_from_tensors([("kv_token", w.kv_token), ("kv_pos", w.kv_pos)])


class Pair:
    """Prefill scheduler + decode scheduler wired through PrefillHandoff / DecodePrealloc."""

    def __init__(self, *, page_size=1, block_size=1, backend_cls=MemcpyBackend, reserved=16,
                 decode_timeout_s=30.0, decode_tokens=512, prefill_timeout_s=30.0, worker_cls=FakeModelWorker):
        self.bootstrap = BootstrapServer("127.0.0.1", _free_port())
        self.port = self.bootstrap.port
        self.page_size, self.block_size, self.backend_cls = page_size, block_size, backend_cls
        self.prefill_timeout_s = prefill_timeout_s
        self.worker_cls = worker_cls
        self.wd = worker_cls(page_size=page_size, block_size=block_size, vocab_size=VOCAB,
                                  max_total_num_tokens=decode_tokens)
        self.d = Scheduler(ServerArgs(page_size=page_size, disaggregation_mode="decode"), self.wd, eos_token_ids=[EOS])

        self.start_prefill_node()
        self.dm = DecodeKVManager(backend_cls(), _specs(self.wd), timeout_s=decode_timeout_s)
        self.d.disagg = DecodePrealloc(self.d, self.dm, num_reserved_decode_tokens=reserved)
        self.outs = {"p": [], "d": []}
        self.room = 1000

    def start_prefill_node(self):
        """A prefill scheduler whose KV manager registers at the bootstrap server (again, after a restart)."""
        self.wp = self.worker_cls(page_size=self.page_size, block_size=self.block_size, vocab_size=VOCAB)
        self.p = Scheduler(ServerArgs(page_size=self.page_size, disaggregation_mode="prefill"), self.wp,
                           eos_token_ids=[EOS])
        self.pm = PrefillKVManager(self.backend_cls(), _specs(self.wp),
                                   bootstrap_url=f"http://127.0.0.1:{self.port}", timeout_s=self.prefill_timeout_s)
        self.p.disagg = PrefillHandoff(self.p, self.pm, bootstrap_server=None)

    def close(self):
        self.p.disagg.close()
        self.d.disagg.close()
        self.bootstrap.close()

    def req(self, rid, ids, max_new=8, room=None, port=None, **sp):
        if room is None:
            self.room += 1
            room = self.room
        return TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=list(ids),
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0, **sp), stream=False,
            bootstrap_host="127.0.0.1", bootstrap_port=self.port if port is None else port, bootstrap_room=room,
        )

    def add(self, rid, ids, **kw):
        r = self.req(rid, ids, **kw)
        self.p.add_request(r)
        self.d.add_request(r)
        return r

    def step(self, which="pd"):
        if "p" in which and self.p.has_work():
            self.outs["p"] += self.p.step()
        if "d" in which and self.d.has_work():
            self.outs["d"] += self.d.step()

    def run(self, which="pd", timeout=20.0):
        deadline = time.monotonic() + timeout
        while any(getattr(self, w).has_work() for w in which):
            assert time.monotonic() < deadline, "PD pair did not finish"
            self.step(which)
            time.sleep(0.001)

    def results(self, side):
        res = {}
        for o in self.outs[side]:
            for i, rid in enumerate(o.rids):
                ids, _ = res.get(rid, ([], None))
                res[rid] = (ids + o.output_ids[i], o.finished_reasons[i])
        return res


def _assert_no_leak(s: Scheduler):
    assert not s.running and not s.waiting_queue and s.chunked_req is None and not s.disagg.has_work()
    s.tree_cache.check_integrity()
    assert s.tree_cache.protected_size() == 0
    assert s.allocator.available_size() + s.tree_cache.total_size() == s.initial_free_slots
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size


@pytest.fixture
def pair_factory():
    made = []

    def make(**kw):
        pr = Pair(**kw)
        made.append(pr)
        return pr

    yield make
    for pr in made:
        pr.close()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("page_size,block_size", [(1, 1), (4, 1), (1, 4), (4, 4)])
def test_decode_node_continues_exactly(pair_factory, page_size, block_size):
    pr = pair_factory(page_size=page_size, block_size=block_size)
    prompts = _prompts(6, seed=page_size + block_size)
    for i, p in enumerate(prompts):
        pr.add(f"r{i}", p, max_new=4 + 3 * i)
    pr.run()
    dres, pres = pr.results("d"), pr.results("p")
    for i, p in enumerate(prompts):
        expect = reference_generate(p, 4 + 3 * i, VOCAB, eos_token_ids=[EOS])
        assert dres[f"r{i}"][0] == expect, f"r{i}"
        assert dres[f"r{i}"][1]["type"] in ("length", "stop")
        # The prefill node answers with the first token only, once the KV has landed.
        assert pres[f"r{i}"][0] == expect[:1]
        assert pres[f"r{i}"][1]["type"] == "length"
    assert all(kind == "prefill" for kind, _ in pr.wp.batch_sizes)  # a prefill node never decodes
    assert all(kind == "decode" for kind, _ in pr.wd.batch_sizes)  # a decode node never prefills
    assert pr.p.get_internal_state()["num_kv_transferred"] == len(prompts)
    assert pr.d.get_internal_state()["num_kv_received"] == len(prompts)
    _assert_no_leak(pr.p)
    _assert_no_leak(pr.d)


def test_prefill_holds_slots_until_transfer_succeeds(pair_factory):
    pr = pair_factory()
    prompt = list(range(10, 30))
    r = pr.req("a", prompt, max_new=4)
    pr.p.add_request(r)
    for _ in range(5):  # the decode node has not asked yet: the prefill node holds the request's KV
        pr.step("p")
        time.sleep(0.01)
    st = pr.p.get_internal_state()
    assert st["num_prefill_inflight_reqs"] == 1
    assert pr.p.allocator.available_size() == pr.p.initial_free_slots - len(prompt)
    assert pr.p.tree_cache.total_size() == 0
    assert pr.p.req_to_token_pool.available_size() == pr.p.req_to_token_pool.size - 1
    assert "a" not in pr.results("p")
    pr.d.add_request(r)  # now the decode side pre-allocates and asks for the room
    pr.run()
    assert pr.results("p")["a"][1]["type"] == "length"
    assert pr.p.tree_cache.total_size() == len(prompt)  # the prompt's KV went to the prefix cache
    assert pr.d.get_internal_state()["num_kv_received"] == 1
    assert pr.results("d")["a"][0] == reference_generate(prompt, 4, VOCAB, eos_token_ids=[EOS])
    _assert_no_leak(pr.p)
    _assert_no_leak(pr.d)


def test_decode_fails_cleanly_when_prefill_unreachable(pair_factory):
    pr = pair_factory(backend_cls=FakeTransferBackend)
    pr.d.add_request(pr.req("x", [5, 6, 7, 8], port=_free_port()))  # nobody listens there
    pr.run("d")
    reason = pr.results("d")["x"][1]
    assert reason["type"] == "abort" and "bootstrap server" in reason["message"]
    assert pr.d.get_internal_state()["num_kv_transfer_failed"] == 1
    _assert_no_leak(pr.d)
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots


def test_decode_times_out_room_whose_kv_never_arrives(pair_factory):
    pr = pair_factory(decode_timeout_s=1.0)
    pr.d.add_request(pr.req("y", list(range(4, 20))))  # the prefill node never gets this request
    pr.step("d")
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots - 16  # pre-allocated
    pr.run("d", timeout=10)
    reason = pr.results("d")["y"][1]
    assert reason["type"] == "abort" and "did not arrive" in reason["message"]
    _assert_no_leak(pr.d)
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots
    # The decode node keeps serving.
    pr.add("z", [9, 10, 11], max_new=5)
    pr.run()
    assert pr.results("d")["z"][0] == reference_generate([9, 10, 11], 5, VOCAB, eos_token_ids=[EOS])
    _assert_no_leak(pr.d)


def test_abort_in_each_queue_frees_slots(pair_factory):
    # 100 reserved decode tokens per request: the second request waits in the pre-allocation queue.
    pr = pair_factory(backend_cls=FakeTransferBackend, reserved=100, decode_tokens=128, decode_timeout_s=1.0)
    pr.d.add_request(pr.req("t", list(range(4, 34))))  # transfer queue (its prefill never runs)
    pr.d.add_request(pr.req("q", list(range(4, 24))))  # pre-allocation queue
    pr.step("d")
    st = pr.d.get_internal_state()
    assert (st["num_decode_transfer_queue_reqs"], st["num_decode_prealloc_queue_reqs"]) == (1, 1)
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots - 30
    pr.d.abort_request(AbortReq(rid="q", message="client went away"))
    pr.d.abort_request(AbortReq(rid="t", message="client went away"))
    pr.step("d")
    res = pr.results("d")
    assert res["q"][1] == {"type": "abort", "message": "client went away"}
    assert res["t"][1] == {"type": "abort", "message": "client went away"}  # answered at once
    # ... but its slots stay reserved while the prefill node could still write them (until the room times out).
    assert pr.d.get_internal_state()["num_decode_draining_reqs"] == 1
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots - 30
    pr.run("d", timeout=10)
    assert pr.d.get_internal_state()["num_decode_draining_reqs"] == 0
    _assert_no_leak(pr.d)
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots

    # Prefill side: a request whose KV is held for a transfer.
    pr.p.add_request(pr.req("h", list(range(4, 24))))
    pr.step("p")
    assert pr.p.get_internal_state()["num_prefill_inflight_reqs"] == 1
    pr.p.abort_request(AbortReq(rid="h", message="client went away"))
    pr.step("p")
    assert pr.results("p")["h"][1]["type"] == "abort"
    _assert_no_leak(pr.p)


def test_duplicate_rid_and_missing_bootstrap_fields(pair_factory):
    pr = pair_factory(backend_cls=FakeTransferBackend, decode_timeout_s=1.0)
    r = pr.req("dup", [4, 5, 6])
    pr.d.add_request(r)
    pr.d.add_request(r)  # same rid while the first one waits for its KV
    pr.step("d")
    assert "already in use" in pr.results("d")["dup"][1]["message"]
    plain = TokenizedGenerateReqInput(rid="plain", input_text=None, input_ids=[4, 5],
                                      sampling_params=SamplingParams(max_new_tokens=2), stream=False)
    pr.d.add_request(plain)
    pr.p.add_request(plain)
    pr.run("p")
    pr.step("d")
    assert "decode node" in pr.results("d")["plain"][1]["message"]
    assert "prefill node" in pr.results("p")["plain"][1]["message"]
    pr.d.abort_request(AbortReq(rid="dup", message="done"))
    pr.run("d", timeout=10)  # its slots are freed once the room times out
    _assert_no_leak(pr.d)
    _assert_no_leak(pr.p)


def test_transfer_failure_is_a_server_error_for_http_clients(pair_factory):
    import json

    from sglite.srt.entrypoints.openai.serving_base import abort_error_response

    pr = pair_factory(backend_cls=FakeTransferBackend)
    pr.d.add_request(pr.req("f", [5, 6, 7], port=_free_port()))
    pr.run("d")
    reason = pr.results("d")["f"][1]
    assert reason["status_code"] == 500
    resp = abort_error_response([{"finish_reason": reason}])
    assert resp.status_code == 500
    body = json.loads(resp.body)
    assert body["type"] == "InternalServerError" and "bootstrap server" in body["message"]
    # A client's own abort stays a normal (200) response with finish_reason abort.
    assert abort_error_response([{"finish_reason": {"type": "abort", "message": "aborted"}}]) is None


def test_decode_follows_a_restarted_prefill_node(pair_factory):
    pr = pair_factory()
    pr.add("a", [4, 5, 6, 7], max_new=3)
    pr.run()
    pr.p.disagg.close()
    pr.start_prefill_node()  # same bootstrap server, new ZMQ endpoint and buffers
    pr.add("b", [8, 9, 10, 11, 12], max_new=3)
    pr.run(timeout=10)
    assert pr.results("d")["b"][0] == reference_generate([8, 9, 10, 11, 12], 3, VOCAB, eos_token_ids=[EOS])
    _assert_no_leak(pr.d)


def test_pd_queue_gauges_in_metrics(pair_factory):
    from sglite.srt.entrypoints.metrics import ServerMetrics

    pr = pair_factory(backend_cls=FakeTransferBackend, reserved=100, decode_tokens=128, decode_timeout_s=1.0)
    pr.d.add_request(pr.req("t", list(range(4, 34))))
    pr.d.add_request(pr.req("q", list(range(4, 24))))
    pr.step("d")
    text = ServerMetrics("m").render(pr.d.get_internal_state(), 0)[0].decode()
    assert 'sglite:num_decode_transfer_queue_reqs{model_name="m"} 1.0' in text
    assert 'sglite:num_decode_prealloc_queue_reqs{model_name="m"} 1.0' in text
    assert 'sglite:num_prefill_inflight_reqs{model_name="m"}' not in text  # not a prefill node
    pr.d.abort_request(AbortReq(abort_all=True, message="done"))
    pr.run("d", timeout=10)
    _assert_no_leak(pr.d)


def test_prefill_fails_room_the_decode_node_never_asks_for(pair_factory):
    pr = pair_factory(backend_cls=FakeTransferBackend, prefill_timeout_s=0.5)
    prompt = list(range(4, 24))
    pr.p.add_request(pr.req("lost", prompt))  # the decode node never sees it
    pr.run("p", timeout=10)
    reason = pr.results("p")["lost"][1]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "never asked" in reason["message"]
    assert pr.p.get_internal_state()["num_kv_transfer_failed"] == 1
    # Its slots were released (the prompt's KV is valid, so it joins the prefix cache).
    assert pr.p.tree_cache.total_size() == len(prompt)
    _assert_no_leak(pr.p)


def test_abort_during_transfer_frees_slots_once_the_kv_lands(pair_factory):
    pr = pair_factory()
    r = pr.req("late", list(range(4, 20)), max_new=4)
    pr.d.add_request(r)
    pr.step("d")  # pre-allocated, want sent; the prefill node has not run the request yet
    pr.d.abort_request(AbortReq(rid="late", message="client went away"))
    pr.step("d")
    assert pr.results("d")["late"][1]["type"] == "abort"
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots - 16  # the prefill node may still write
    pr.p.add_request(r)
    pr.run()  # the prefill node ships the KV; then the decode node frees the slots without caching them
    assert pr.d.allocator.available_size() == pr.d.initial_free_slots
    assert pr.d.tree_cache.total_size() == 0
    _assert_no_leak(pr.d)
    _assert_no_leak(pr.p)


class LogprobWorker(FakeModelWorker):
    """The fake model with a made-up, token-determined logprob per sampled token (a worker that supports them)."""

    supports_logprobs = True

    def forward_prefill(self, batch):
        out = super().forward_prefill(batch)
        batch.next_token_logprobs = [[-(t + 1) / 128 for t in toks] for toks in out]
        return out

    def forward_decode(self, batch):
        out = super().forward_decode(batch)
        batch.next_token_logprobs = [[-(t + 1) / 128 for t in toks] for toks in out]
        return out


def test_first_token_logprob_travels_with_the_kv(pair_factory):
    pr = pair_factory(worker_cls=LogprobWorker)
    prompt = [7, 8, 9, 10, 11]
    r = pr.req("lp", prompt, max_new=6)
    r.return_logprob = True
    pr.p.add_request(r)
    pr.d.add_request(r)
    pr.run()
    lps = []
    for o in pr.outs["d"]:
        for i, rid in enumerate(o.rids):
            if rid == "lp":
                lps += o.output_token_logprobs[i]
    expect = reference_generate(prompt, 6, VOCAB, eos_token_ids=[EOS])
    assert pr.results("d")["lp"][0] == expect
    assert lps == [-(t + 1) / 128 for t in expect]  # one per token, the first one from the prefill node
