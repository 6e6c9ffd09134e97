"""Scheduler + TpModelWorker + ModelRunner on a tiny random Qwen3: greedy tokens equal transformers'
greedy generation through batching, prefix-cache hits, chunked prefill, retraction and aborts."""

import random

import pytest
import torch

from sglite.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglite.srt.managers.scheduler import Scheduler, SchedulerConfig
from sglite.srt.managers.tp_worker import TpModelWorker
from sglite.srt.model_executor.compiled_decode_runner import cpp_compiler
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 150  # 105, plus one Inductor compile of the tiny model (two graphs)

rng = random.Random(0)
SYSTEM = [rng.randrange(3, 500) for _ in range(19)]
PROMPTS = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 12, 30, 7)] + [
    SYSTEM + [101, 102],
    SYSTEM + [7, 8, 9, 10],
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3"))
    # eos None: transformers' generate then never stops early, so lengths are fixed.
    build_tiny_model(d, "qwen3", seed=3, with_tokenizer=False, eos_token_id=None)
    hf = load_hf_model(d)
    expected = {}
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
            expected[i] = ids[0, len(p) :].tolist()
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(hf, PROMPTS, [expected[i] for i in range(len(PROMPTS))])
    return d, expected


def _scheduler(model_dir, config=None, **kw):
    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=2, **kw).validate()
    worker = TpModelWorker.create(args)
    return Scheduler(args, worker, config=config)


def _req(rid, ids, max_new=MAX_NEW, **kw):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=list(ids), sampling_params=sp, **kw)


def _collect(outs):
    res = {}
    for o in outs:
        for i, rid in enumerate(o.rids):
            prev = res.get(rid, {"ids": []})
            res[rid] = {"ids": prev["ids"] + o.output_ids[i], "reason": o.finished_reasons[i], "cached": o.cached_tokens[i]}
    return res


def _assert_clean(s):
    s.tree_cache.check_integrity()
    assert s.allocator.available_size() + s.tree_cache.total_size() == s.initial_free_slots
    assert s.flush_cache().success and s.allocator.available_size() == s.initial_free_slots


@pytest.mark.parametrize("page_size", [1, 4])
def test_batch_greedy_equals_transformers(tiny, rank0, page_size):
    d, expected = tiny
    s = _scheduler(d, page_size=page_size)
    for i, p in enumerate(PROMPTS):
        s.add_request(_req(f"r{i}", p, stream=i % 2 == 1))
    res = _collect(s.run_until_idle())
    for i in range(len(PROMPTS)):
        assert res[f"r{i}"]["ids"] == expected[i], f"prompt {i}"
        assert res[f"r{i}"]["reason"] == {"type": "length", "length": MAX_NEW}
    _assert_clean(s)


def test_shared_prefix_hit_reports_cached_tokens_and_same_tokens(tiny, rank0):
    d, expected = tiny
    s = _scheduler(d)
    s.add_request(_req("first", PROMPTS[5]))
    res = _collect(s.run_until_idle())
    s.add_request(_req("second", PROMPTS[6]))
    res.update(_collect(s.run_until_idle()))
    assert res["first"]["cached"] == 0
    assert res["second"]["cached"] >= len(SYSTEM)
    assert res["first"]["ids"] == expected[5] and res["second"]["ids"] == expected[6]
    _assert_clean(s)


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_prefill_same_tokens(tiny, rank0, mixed):
    d, expected = tiny
    s = _scheduler(d, chunked_prefill_size=4, enable_mixed_chunk=mixed)
    outs = []
    for i, p in enumerate(PROMPTS):
        s.add_request(_req(f"r{i}", p))
        outs += s.step()  # staggered arrivals: later prompts prefill while earlier ones decode
    res = _collect(outs + s.run_until_idle())
    assert s.num_prefill_forwards > len(PROMPTS)
    for i in range(len(PROMPTS)):
        assert res[f"r{i}"]["ids"] == expected[i]
    _assert_clean(s)


@pytest.mark.skipif(cpp_compiler() is None, reason="Inductor's CPU backend needs g++ (or $CXX)")
def test_mixed_steps_through_the_compiled_graphs_same_tokens(tiny, rank0):
    """Under --enable-torch-compile, chunked prompts arriving while others decode run as mixed steps through the
    token graph, and every request still gets transformers' tokens."""
    d, expected = tiny
    s = _scheduler(d, chunked_prefill_size=4, enable_mixed_chunk=True, enable_torch_compile=True,
                   torch_compile_max_bs=8)
    compiled = s.worker.target_runner.compiled_decode
    new_tokens_seen, run = [], compiled.run

    def spy(fb):
        new_tokens_seen.append(list(fb.extend_seq_lens_cpu) if fb.forward_mode == ForwardMode.EXTEND else [])
        return run(fb)

    compiled.run = spy
    outs = []
    for i, p in enumerate(PROMPTS):
        s.add_request(_req(f"r{i}", p))
        outs += s.step()
    res = _collect(outs + s.run_until_idle())
    # A prompt chunk beside decode rows (one token each) went through the compiled token graph.
    assert any(len(n) > 1 and max(n) > 1 and n.count(1) >= 1 for n in new_tokens_seen), new_tokens_seen
    for i in range(len(PROMPTS)):
        assert res[f"r{i}"]["ids"] == expected[i]
    _assert_clean(s)


def test_retraction_under_tiny_kv_budget(tiny, rank0):
    d, expected = tiny
    # 64 KV slots for 7 requests of up to 30 + 12 tokens: decode must retract and requeue.
    s = _scheduler(d, max_total_tokens=64, config=SchedulerConfig(init_new_token_ratio=0.0, min_new_token_ratio=0.0))
    for i, p in enumerate(PROMPTS):
        s.add_request(_req(f"r{i}", p, stream=True))
    res = _collect(s.run_until_idle())
    assert s.num_retractions > 0
    for i in range(len(PROMPTS)):
        assert res[f"r{i}"]["ids"] == expected[i]
    _assert_clean(s)


def test_abort_frees_slots(tiny, rank0):
    d, expected = tiny
    s = _scheduler(d)
    for i, p in enumerate(PROMPTS):
        s.add_request(_req(f"r{i}", p, max_new=40))
    outs = s.step() + s.step() + s.step()
    assert s.running
    s.abort_request(AbortReq(rid=s.running[0].rid))
    s.abort_request(AbortReq(abort_all=True))
    res = _collect(outs + s.run_until_idle())
    assert len(res) == len(PROMPTS) and all(r["reason"]["type"] == "abort" for r in res.values())
    for i in range(len(PROMPTS)):
        assert res[f"r{i}"]["ids"] == expected[i][: len(res[f"r{i}"]["ids"])]
    _assert_clean(s)


def test_logprobs_equal_transformers(tiny, rank0):
    d, expected = tiny
    hf = load_hf_model(d)
    s = _scheduler(d, chunked_prefill_size=8)
    prompts = [PROMPTS[1], PROMPTS[3]]
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, return_logprob=True, stream=i == 0))
    s.add_request(_req("plain", PROMPTS[2]))
    outs = s.run_until_idle()
    got: dict = {}
    for o in outs:
        for j, rid in enumerate(o.rids):
            lp = o.output_token_logprobs[j] if o.output_token_logprobs is not None else None
            if rid == "plain":
                assert lp is None
            else:
                got[rid] = got.get(rid, []) + lp
    for i, p in enumerate(prompts):
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
        ids = gen.sequences[0, len(p) :]
        ref = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, ids)]
        assert len(got[f"r{i}"]) == MAX_NEW
        torch.testing.assert_close(torch.tensor(got[f"r{i}"]), torch.tensor(ref), atol=1e-4, rtol=0)
    _assert_clean(s)


def test_context_len_is_the_models_not_the_request_table_width(tiny, rank0):
    model_dir, _ = tiny
    s = _scheduler(model_dir)
    # tiny models have max_position_embeddings 512; req->token rows are wider (speculative/page slack)
    assert s.context_len == 512 < s.req_to_token_pool.req_to_token.shape[1]
    s.add_request(_req("too-long", list(range(8, 8 + 500)), max_new=13))
    out = _collect(s.run_until_idle())["too-long"]
    assert out["reason"]["type"] == "abort" and "context length 512" in out["reason"]["message"]
    _assert_clean(s)


POISON_SEED = 666


class _PoisonedSampler(torch.nn.Module):
    """The runner's sampler, raising for any batch that holds the poisoned request at ``from_step`` or later."""

    def __init__(self, inner, from_step: int):
        super().__init__()
        self.inner, self.from_step = inner, from_step

    def forward(self, logits, info):
        for seed, offset in zip(info.seeds, info.seed_offsets):
            if seed == POISON_SEED and offset >= self.from_step:
                raise ValueError("injected sampling fault")
        return self.inner(logits, info)


@pytest.mark.parametrize("page_size,fault_step", [(1, 0), (4, 0), (1, 3), (4, 3)])
def test_a_fault_in_one_requests_sampling_fails_that_request_only(tiny, rank0, page_size, fault_step):
    """Failure isolation: the batch is retried request by request; only the faulty one ends (status 500)."""
    d, expected = tiny
    s = _scheduler(d, page_size=page_size)
    runner = s.worker.target_runner
    runner.sampler = _PoisonedSampler(runner.sampler, from_step=fault_step)
    poisoned = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, seed=POISON_SEED)
    for i, p in enumerate(PROMPTS):
        s.add_request(_req(f"r{i}", p, stream=i % 2 == 1))
        if i == 2:  # in the middle of the batch
            s.add_request(TokenizedGenerateReqInput(rid="bad", input_text=None, input_ids=PROMPTS[1], sampling_params=poisoned))
    res = _collect(s.run_until_idle())
    bad = res["bad"]["reason"]
    assert bad["type"] == "abort" and bad["status_code"] == 500 and "injected sampling fault" in bad["message"]
    assert len(res["bad"]["ids"]) == fault_step
    for i in range(len(PROMPTS)):
        assert res[f"r{i}"]["ids"] == expected[i], f"prompt {i}"
    assert s.num_failed_requests == 1
    _assert_clean(s)
    # The scheduler keeps serving: the same prompt without the poison is served in full.
    s.add_request(_req("after", PROMPTS[1]))
    assert _collect(s.run_until_idle())["after"]["ids"] == expected[1]
    _assert_clean(s)


def test_stats_lines_in_sglangs_format(tiny, rank0, caplog):
    """Operability: a "Prefill batch." line per prefill and a "Decode batch." line every --decode-log-interval steps."""
    import logging
    import re

    d, _ = tiny
    s = _scheduler(d, decode_log_interval=4)
    for i, p in enumerate(PROMPTS[:3]):
        s.add_request(_req(f"r{i}", p))
    with caplog.at_level(logging.INFO, logger="sglite.srt.managers.scheduler"):
        s.run_until_idle()
    lines = [r.getMessage() for r in caplog.records]
    prefill = [m for m in lines if m.startswith("Prefill batch.")]
    decode = [m for m in lines if m.startswith("Decode batch.")]
    assert prefill and re.fullmatch(
        r"Prefill batch\. #new-seq: 3, #new-token: \d+, #cached-token: 0, token usage: \d\.\d\d, #running-req: 0, #queue-req: 0",
        prefill[0],
    ), prefill
    assert len(decode) == s.num_decode_forwards // 4, decode
    assert re.fullmatch(
        r"Decode batch\. #running-req: 3, #token: \d+, token usage: 0\.\d\d, gen throughput \(token/s\): \d+\.\d\d, #queue-req: 0",
        decode[0],
    ), decode
