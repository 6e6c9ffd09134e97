"""run_scheduler_process over real ZMQ sockets with a tiny model: ready message, generation equal to
transformers, abort, internal state (free slots back to the initial count), flush, health."""

import multiprocessing as mp
import shutil

import pytest
import torch
import zmq

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    PortArgs,
    SchedulerInitError,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from sglite.srt.managers.scheduler_process import run_scheduler_process
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 120

PROMPTS = [[5, 17, 300, 41, 7, 99], [100, 200, 300, 400, 12, 13, 14, 15, 16], [42]]
MAX_NEW = 10


def _req(rid, ids, max_new=MAX_NEW, stream=False):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=ids, sampling_params=sp, stream=stream)


@pytest.mark.timeout(240)
def test_scheduler_process_end_to_end(tmp_path):
    torch.set_num_threads(1)
    model_dir = build_tiny_model(str(tmp_path / "m"), "qwen3", seed=1, eos_token_id=None)
    hf = load_hf_model(model_dir)
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    assert_clear_greedy_margins(hf, PROMPTS, expected)  # exact equality below needs no near-ties
    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=2).validate()
    port_args = PortArgs.create(args)
    ctx = zmq.Context()
    detok = ctx.socket(zmq.PULL)
    detok.bind(port_args.detokenizer_ipc_name)
    mpctx = mp.get_context("spawn")
    reader, writer = mpctx.Pipe(duplex=False)
    proc = mpctx.Process(target=run_scheduler_process, args=(args, port_args, 0, 1, writer), daemon=True)
    proc.start()
    writer.close()
    try:
        assert reader.poll(180), "scheduler did not report ready"
        ready = reader.recv()
        assert not isinstance(ready, SchedulerInitError), ready.traceback
        assert isinstance(ready, SchedulerReady) and ready.vocab_size == 512 and ready.max_total_num_tokens > 0
        send = ctx.socket(zmq.PUSH)
        send.connect(port_args.scheduler_input_ipc_name)

        def recv(kind, timeout_ms=60_000):
            assert detok.poll(timeout_ms), f"no {kind.__name__} from the scheduler"
            msg = detok.recv_pyobj()
            assert isinstance(msg, kind), msg
            return msg

        for i, p in enumerate(PROMPTS):
            send.send_pyobj(_req(f"r{i}", p, stream=(i == 0)))
        send.send_pyobj(_req("long", [9] * 20, max_new=400))
        got: dict = {}
        finished: dict = {}
        while len(finished) < len(PROMPTS):
            out = recv(BatchTokenIDOut)
            for j, rid in enumerate(out.rids):
                got[rid] = got.get(rid, []) + out.output_ids[j]
                if out.finished_reasons[j] is not None:
                    finished[rid] = out.finished_reasons[j]
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
        send.send_pyobj(AbortReq(rid="long"))
        while "long" not in finished:
            out = recv(BatchTokenIDOut)
            for j, rid in enumerate(out.rids):
                if out.finished_reasons[j] is not None:
                    finished[rid] = out.finished_reasons[j]
        assert finished["long"]["type"] == "abort"

        send.send_pyobj(GetInternalStateReq())
        state = recv(GetInternalStateReqOutput).internal_state
        assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
        assert state["available_kv_slots"] + state["tree_cache_size"] == state["initial_free_slots"]
        assert state["memory_plan"]["max_total_num_tokens"] == ready.max_total_num_tokens
        send.send_pyobj(FlushCacheReq())
        assert recv(FlushCacheReqOutput).success
        send.send_pyobj(GetInternalStateReq())
        state = recv(GetInternalStateReqOutput).internal_state
        assert state["available_kv_slots"] == state["initial_free_slots"]
        send.send_pyobj(HealthCheckReq(rid="h1"))
        assert recv(HealthCheckOutput).rid == "h1"
    finally:
        proc.kill()
        proc.join(5)
        ctx.destroy(linger=0)
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


@pytest.mark.timeout(300)
def test_scheduler_process_tp2_lockstep(tmp_path):
    """Two ranks: rank 0 takes requests and broadcasts them; outputs equal transformers."""
    torch.set_num_threads(1)
    model_dir = build_tiny_model(str(tmp_path / "m"), "qwen3", seed=2, eos_token_id=None)
    hf = load_hf_model(model_dir)
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    assert_clear_greedy_margins(hf, PROMPTS, expected)  # exact equality below needs no near-ties
    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=2, tp_size=2).validate()
    port_args = PortArgs.create(args)
    ctx = zmq.Context()
    detok = ctx.socket(zmq.PULL)
    detok.bind(port_args.detokenizer_ipc_name)
    mpctx = mp.get_context("spawn")
    procs, readers = [], []
    for rank in range(2):
        reader, writer = mpctx.Pipe(duplex=False)
        proc = mpctx.Process(target=run_scheduler_process, args=(args, port_args, rank, 2, writer), daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)
    try:
        for reader in readers:
            assert reader.poll(180), "a scheduler rank did not report ready"
            ready = reader.recv()
            assert isinstance(ready, SchedulerReady), getattr(ready, "traceback", ready)
        send = ctx.socket(zmq.PUSH)
        send.connect(port_args.scheduler_input_ipc_name)
        for i, p in enumerate(PROMPTS):
            send.send_pyobj(_req(f"r{i}", p))
        got: dict = {}
        done = set()
        while len(done) < len(PROMPTS):
            assert detok.poll(120_000), "no output from rank 0"
            out = detok.recv_pyobj()
            for j, rid in enumerate(out.rids):
                got[rid] = got.get(rid, []) + out.output_ids[j]
                if out.finished_reasons[j] is not None:
                    done.add(rid)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
        assert all(p.is_alive() for p in procs)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)
        ctx.destroy(linger=0)
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def test_tokenizer_thread_starts_after_transformers_auto_modules_are_imported():
    """The tokenizer load thread starts only once this thread has imported transformers' auto modules: a first import
    of them from two threads at once failed a cold start ("cannot import name 'CONFIG_MAPPING'"). A fresh interpreter,
    since this process imported transformers long ago."""
    import subprocess
    import sys

    code = """
import sys
from sglite.srt.managers.scheduler_process import submit_tokenizer_load
AUTO = ("transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto")
print(all(m in sys.modules for m in AUTO))
class Pool:
    def submit(self, fn, *args):
        print(all(m in sys.modules for m in AUTO), fn.__name__, args)
        return "future"
print(submit_tokenizer_load(Pool(), "/some/model"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split("\n")[:3] == ["False", "True load_tokenizer ('/some/model',)", "future"]
