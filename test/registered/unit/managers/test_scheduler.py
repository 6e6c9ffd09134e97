"""Scheduler with a model-free worker: batching, prefix reuse, chunking, retraction, abort, speculation.

The fake worker's next token is a hash of the sequence it reads back through req_to_token and its
fake KV pool, so any slot mix-up changes the tokens; the reference is the same hash over a list.
"""

import random

import pytest

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    GetInternalStateReq,
    TokenizedGenerateReqInput,
)
from sglite.srt.managers.scheduler import Scheduler, SchedulerConfig
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs
from sglite.testing.fake_model_worker import (
    FakeModelWorker,
    reference_generate,
    reference_generate_with_stop_str,
    tiny_char_tokenizer,
)

SUITE = "unit-cpu"
EST_TIME = 20

VOCAB = 64
EOS = 3


def _sched(worker, *, eos=(EOS,), tokenizer=None, config=None, **server_kw):
    args = ServerArgs(page_size=worker.token_to_kv_pool_allocator.page_size, **server_kw)
    return Scheduler(args, worker, tokenizer=tokenizer, eos_token_ids=eos, config=config)


def _req(rid, ids, max_new=16, stream=False, **sp):
    return TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0, **sp), stream=stream
    )


def _collect(outs):
    """rid -> (all output ids, finish reason, last cached_tokens, spec_verify_ct)."""
    res: dict = {}
    for o in outs:
        for i, rid in enumerate(o.rids):
            ids, _, _, _ = res.get(rid, ([], None, 0, 0))
            res[rid] = (ids + o.output_ids[i], o.finished_reasons[i], o.cached_tokens[i], o.spec_verify_ct[i])
    return res


def _assert_no_leak(s: Scheduler):
    assert not s.running and not s.waiting_queue and s.chunked_req is None
    s.tree_cache.check_integrity()
    assert s.tree_cache.protected_size() == 0
    assert s.allocator.available_size() + s.tree_cache.total_size() == s.initial_free_slots
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size
    assert s.flush_cache().success
    assert s.allocator.available_size() == s.initial_free_slots


def _prompts(n, seed=0, lo=3, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("block_size", [1, 4])
def test_batch_matches_reference(page_size, block_size):
    w = FakeModelWorker(page_size=page_size, block_size=block_size, vocab_size=VOCAB)
    s = _sched(w)
    prompts = _prompts(10, seed=page_size * 10 + block_size)
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, max_new=5 + 3 * i, stream=(i % 2 == 0)))
    res = _collect(s.run_until_idle())
    for i, p in enumerate(prompts):
        ids, reason, _, verify_ct = res[f"r{i}"]
        expect = reference_generate(p, 5 + 3 * i, VOCAB, eos_token_ids=[EOS])
        assert ids == expect, f"r{i}"
        assert reason["type"] == ("stop" if expect[-1] == EOS and len(expect) < 5 + 3 * i else "length")
        if block_size > 1:
            assert 0 < verify_ct <= len(expect)
    assert any(kind == "decode" and bs > 1 for kind, bs in w.batch_sizes)  # really batched
    if block_size > 1:
        avg = s.get_internal_state()["avg_spec_accept_length"]
        assert 1.0 <= avg <= block_size
    _assert_no_leak(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_cached_and_exact(page_size):
    w = FakeModelWorker(page_size=page_size, vocab_size=VOCAB)
    s = _sched(w)
    system = _prompts(1, seed=5, lo=21, hi=21)[0]
    a, b = system + [10, 11], system + [12, 13, 14]
    s.add_request(_req("a", a, max_new=8, ignore_eos=True))
    res = _collect(s.run_until_idle())
    assert res["a"][2] == 0
    s.add_request(_req("b", b, max_new=8, ignore_eos=True))
    res.update(_collect(s.run_until_idle()))
    assert res["b"][2] >= 20 // page_size * page_size > 0
    assert res["b"][0] == reference_generate(b, 8, VOCAB, ignore_eos=True)
    # The very same prompt again: everything but the last token comes from the cache.
    s.add_request(_req("a2", a, max_new=8, ignore_eos=True))
    res.update(_collect(s.run_until_idle()))
    assert res["a2"][0] == res["a"][0] == reference_generate(a, 8, VOCAB, ignore_eos=True)
    assert res["a2"][2] == (len(a) - 1) // page_size * page_size
    _assert_no_leak(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_same_tokens(page_size):
    w = FakeModelWorker(page_size=page_size, vocab_size=VOCAB)
    s = _sched(w, chunked_prefill_size=page_size * 2 if page_size > 1 else 3)
    prompts = _prompts(6, seed=7, lo=10, hi=40)
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, max_new=6, ignore_eos=True))
    res = _collect(s.run_until_idle())
    for i, p in enumerate(prompts):
        assert res[f"r{i}"][0] == reference_generate(p, 6, VOCAB, ignore_eos=True)
    assert w.batch_sizes.count(("prefill", 1)) > len(prompts)  # prompts really were split
    _assert_no_leak(s)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("block_size", [1, 3])
def test_retraction_under_tiny_kv_budget(page_size, block_size):
    w = FakeModelWorker(max_total_num_tokens=96, page_size=page_size, block_size=block_size, vocab_size=VOCAB)
    # Admit greedily (no decode reserve) so decode must run out of slots and retract.
    s = _sched(w, config=SchedulerConfig(init_new_token_ratio=0.0, min_new_token_ratio=0.0))
    prompts = _prompts(8, seed=11, lo=6, hi=14)
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, max_new=24, ignore_eos=True, stream=True))
    res = _collect(s.run_until_idle())
    assert s.num_retractions > 0
    for i, p in enumerate(prompts):
        ids, reason, _, _ = res[f"r{i}"]
        assert ids == reference_generate(p, 24, VOCAB, ignore_eos=True)
        assert reason == {"type": "length", "length": 24}
    _assert_no_leak(s)


def test_abort_frees_slots_everywhere():
    w = FakeModelWorker(page_size=1, vocab_size=VOCAB, max_running_requests=3)
    s = _sched(w, chunked_prefill_size=4)
    prompts = _prompts(6, seed=3, lo=8, hi=20)
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, max_new=30, ignore_eos=True))
    outs = []
    for _ in range(4):
        outs += s.step()
    live = {r.rid: r for r in s.running + s.waiting_queue + ([s.chunked_req] if s.chunked_req else [])}
    # Abort one of each: a running one, a waiting one, and the chunked one if any.
    targets = [s.running[0].rid if s.running else None, s.waiting_queue[-1].rid]
    if s.chunked_req is not None:
        targets.append(s.chunked_req.rid)
    for rid in filter(None, targets):
        s.abort_request(AbortReq(rid=rid))
    outs += s.run_until_idle()
    res = _collect(outs)
    assert set(res) == set(f"r{i}" for i in range(6))
    for i, p in enumerate(prompts):
        ids, reason, _, _ = res[f"r{i}"]
        if f"r{i}" in targets:
            assert reason["type"] == "abort"
            assert ids == reference_generate(p, 30, VOCAB, ignore_eos=True)[: len(ids)]
        else:
            assert ids == reference_generate(p, 30, VOCAB, ignore_eos=True)
    assert len(live) >= 3
    _assert_no_leak(s)


def test_abort_all_and_unknown_rid():
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w)
    for i, p in enumerate(_prompts(5, seed=4)):
        s.add_request(_req(f"r{i}", p, max_new=50, ignore_eos=True))
    s.step()
    s.step()
    s.abort_request(AbortReq(rid="nope"))
    s.abort_request(AbortReq(abort_all=True))
    res = _collect(s.run_until_idle())
    assert all(v[1]["type"] == "abort" for v in res.values()) and len(res) == 5
    _assert_no_leak(s)


def test_stop_token_ids_inside_speculative_run_truncate():
    w = FakeModelWorker(block_size=5, vocab_size=VOCAB, seed=3)
    s = _sched(w, eos=())
    prompts = _prompts(6, seed=21)
    for i, p in enumerate(prompts):
        ref = reference_generate(p, 40, VOCAB, ignore_eos=True)
        stop_tok = ref[7]  # stops at the first occurrence, wherever it falls inside a verify block
        s.add_request(_req(f"r{i}", p, max_new=40, stop_token_ids=[stop_tok]))
    res = _collect(s.run_until_idle())
    for i, p in enumerate(prompts):
        ref = reference_generate(p, 40, VOCAB, ignore_eos=True)
        expect = reference_generate(p, 40, VOCAB, stop_token_ids=[ref[7]])
        assert res[f"r{i}"][0] == expect
        assert res[f"r{i}"][1] == {"type": "stop", "matched": ref[7]}
    # Accepted-token counters hold what the requests kept: every output token but prefill's first.
    assert s.spec_accepted_total == sum(len(res[f"r{i}"][0]) - 1 for i in range(len(prompts)))
    _assert_no_leak(s)


def test_stop_strings():
    tok = tiny_char_tokenizer(VOCAB)
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w, tokenizer=tok)
    prompts = _prompts(4, seed=8)
    stops = {}
    for i, p in enumerate(prompts):
        text = tok.decode(reference_generate(p, 30, VOCAB, ignore_eos=True))
        stops[i] = [text[9:11]]
        s.add_request(_req(f"r{i}", p, max_new=30, ignore_eos=True, stop=stops[i]))
    res = _collect(s.run_until_idle())
    for i, p in enumerate(prompts):
        expect = reference_generate_with_stop_str(p, 30, VOCAB, stops[i], tok)
        assert res[f"r{i}"][0] == expect
        assert res[f"r{i}"][1] == {"type": "stop", "matched": stops[i][0]}
    _assert_no_leak(s)


def test_max_running_requests_bound_and_fcfs():
    w = FakeModelWorker(vocab_size=VOCAB, max_running_requests=8)
    s = _sched(w, max_running_requests=3, schedule_policy="fcfs")
    prompts = _prompts(9, seed=9)
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, max_new=6, ignore_eos=True))
    res = _collect(s.run_until_idle())
    assert max(bs for _, bs in w.batch_sizes) <= 3
    for i, p in enumerate(prompts):
        assert res[f"r{i}"][0] == reference_generate(p, 6, VOCAB, ignore_eos=True)
    _assert_no_leak(s)


def test_lpm_prefers_cached_prefix():
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w, max_running_requests=1, schedule_policy="lpm")
    base = _prompts(1, seed=2, lo=16, hi=16)[0]
    s.add_request(_req("warm", base + [5], max_new=2, ignore_eos=True))
    s.run_until_idle()
    s.add_request(_req("cold", [7] * 12, max_new=2, ignore_eos=True))
    s.add_request(_req("hot", base + [6], max_new=2, ignore_eos=True))
    s.step()  # admits one request (max_running_requests=1)
    assert [r.rid for r in s.running] == ["hot"] or (s.running == [] and s.waiting_queue[0].rid == "cold")
    s.run_until_idle()
    _assert_no_leak(s)


def test_disable_radix_cache_and_control_messages():
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w, disable_radix_cache=True)
    p = _prompts(1, seed=1, lo=20, hi=20)[0]
    s.add_request(_req("a", p, max_new=4, ignore_eos=True))
    s.run_until_idle()
    s.add_request(_req("b", p, max_new=4, ignore_eos=True))
    res = _collect(s.run_until_idle())
    assert res["b"][2] == 0 and res["b"][0] == reference_generate(p, 4, VOCAB, ignore_eos=True)
    assert s.allocator.available_size() == s.initial_free_slots
    s.add_request(_req("c", p, max_new=4))
    s.step()
    assert s.handle(FlushCacheReq()).success is False  # refused while running
    state = s.handle(GetInternalStateReq()).internal_state
    assert state["num_running_reqs"] == 1 and state["memory_plan"]["max_total_num_tokens"] == 512
    s.run_until_idle()
    _assert_no_leak(s)


def test_unservable_requests_finish_with_abort():
    w = FakeModelWorker(vocab_size=VOCAB, max_total_num_tokens=64, context_len=100)
    s = _sched(w)
    s.add_request(_req("too_long", [5] * 90, max_new=20))
    s.add_request(_req("too_big", [5] * 50, max_new=40))
    s.add_request(_req("ok", [5] * 5, max_new=3, ignore_eos=True))
    s.add_request(_req("ok", [5] * 5, max_new=3))  # duplicate rid
    res = _collect(s.run_until_idle())
    assert res["too_long"][1]["type"] == "abort" and "context length" in res["too_long"][1]["message"]
    assert res["too_big"][1]["type"] == "abort" and "KV" in res["too_big"][1]["message"]
    assert res["ok"][0] == reference_generate([5] * 5, 3, VOCAB, ignore_eos=True)
    _assert_no_leak(s)


@pytest.mark.parametrize(
    "page_size,block_size,radix,policy,seed",
    [(2, 2, True, "lpm", 99), (1, 1, True, "fcfs", 5), (4, 3, True, "lpm", 6), (1, 4, False, "lpm", 7), (2, 1, False, "fcfs", 8)],
)
def test_random_workload_invariants(page_size, block_size, radix, policy, seed):
    """Random arrivals, aborts and a tight pool; outputs exact, no slot leaks."""
    rng = random.Random(seed)
    w = FakeModelWorker(
        max_total_num_tokens=64, page_size=page_size, block_size=block_size, vocab_size=VOCAB, max_running_requests=6, seed=seed
    )
    s = _sched(
        w,
        chunked_prefill_size=8,
        disable_radix_cache=not radix,
        schedule_policy=policy,
        config=SchedulerConfig(init_new_token_ratio=0.05, min_new_token_ratio=0.0),
    )
    prompts, max_news, aborted, outs = {}, {}, set(), []
    shared = _prompts(1, seed=1, lo=10, hi=10)[0]
    for step in range(400):
        if step < 120 and rng.random() < 0.3:
            rid = f"r{step}"
            prompts[rid] = (shared if rng.random() < 0.5 else []) + _prompts(1, seed=step, lo=2, hi=12)[0]
            max_news[rid] = rng.randint(1, 20)
            s.add_request(_req(rid, prompts[rid], max_new=max_news[rid], stream=True))
        if rng.random() < 0.05 and (s.running or s.waiting_queue):
            victim = rng.choice(s.running + s.waiting_queue).rid
            aborted.add(victim)
            s.abort_request(AbortReq(rid=victim))
        outs += s.step()
        s.tree_cache.check_integrity()
    outs += s.run_until_idle()
    res = _collect(outs)
    assert set(res) == set(prompts)
    for rid, p in prompts.items():
        ids, reason, _, _ = res[rid]
        ref = reference_generate(p, max_news[rid], VOCAB, eos_token_ids=[EOS])
        if rid in aborted and reason["type"] == "abort":
            assert ids == ref[: len(ids)], rid
        else:
            assert ids == ref, rid
    assert s.num_retractions > 0
    _assert_no_leak(s)


@pytest.mark.parametrize("page_size", [1, 2])
def test_chunked_prompt_yields_slots_to_decoding_request(page_size):
    """A half-prefilled prompt that filled the pool is retracted (not the lone decoding request aborted)."""
    w = FakeModelWorker(max_total_num_tokens=40, page_size=page_size, vocab_size=VOCAB)
    s = _sched(w, chunked_prefill_size=4, config=SchedulerConfig(init_new_token_ratio=0.0, min_new_token_ratio=0.0))
    a, b = [5, 6, 7, 8], _prompts(1, seed=12, lo=36, hi=36)[0]
    s.add_request(_req("a", a, max_new=20, ignore_eos=True))
    s.step()  # a is prefilled and decoding
    s.add_request(_req("b", b, max_new=4, ignore_eos=True))
    res = _collect(s.run_until_idle())
    assert s.num_retractions > 0
    assert res["a"][0] == reference_generate(a, 20, VOCAB, ignore_eos=True)
    assert res["b"][0] == reference_generate(b, 4, VOCAB, ignore_eos=True)
    _assert_no_leak(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_chunk_decodes_inside_prefill_batches(page_size):
    w = FakeModelWorker(page_size=page_size, vocab_size=VOCAB)
    s = _sched(w, chunked_prefill_size=8, enable_mixed_chunk=True)
    a, b = [5, 6, 7], _prompts(1, seed=13, lo=40, hi=40)[0]
    s.add_request(_req("a", a, max_new=12, ignore_eos=True, stream=True))
    outs = s.step()
    s.add_request(_req("b", b, max_new=6, ignore_eos=True))
    res = _collect(outs + s.run_until_idle())
    assert ("prefill", 2) in w.batch_sizes  # b's chunks carried a's decode tokens
    assert res["a"][0] == reference_generate(a, 12, VOCAB, ignore_eos=True)
    assert res["b"][0] == reference_generate(b, 6, VOCAB, ignore_eos=True)
    _assert_no_leak(s)


def test_mixed_chunk_prefill_share_is_bounded_while_requests_decode():
    # The ITL bound: once a request decodes, every forward carries its token, and an arriving prompt adds at
    # most --mixed-chunk-prefill-size prefill tokens per forward; alone, a prompt prefills with the full chunk.
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w, chunked_prefill_size=64, enable_mixed_chunk=True, mixed_chunk_prefill_size=8)
    a, b = _prompts(1, seed=3, lo=30, hi=30)[0], _prompts(1, seed=14, lo=40, hi=40)[0]
    s.add_request(_req("a", a, max_new=12, ignore_eos=True, stream=True))
    outs = s.step()
    assert w.batch_sizes == [("prefill", 1)]  # 30 tokens in one forward: nothing was decoding
    s.add_request(_req("b", b, max_new=6, ignore_eos=True))
    a_tokens, steps = len(_collect(outs)["a"][0]), 0
    while s.chunked_req is not None or s.waiting_queue:
        before = s.allocator.available_size()
        outs += s.step()
        steps += 1
        now = len(_collect(outs)["a"][0])
        assert now == a_tokens + 1, "a decoding request waited a whole prefill"
        a_tokens = now
        assert before - s.allocator.available_size() <= 8 + 1  # b's share plus a's decode slot
    assert steps == 5  # ceil(40 / 8) mixed forwards
    res = _collect(outs + s.run_until_idle())
    assert res["a"][0] == reference_generate(a, 12, VOCAB, ignore_eos=True)
    assert res["b"][0] == reference_generate(b, 6, VOCAB, ignore_eos=True)
    _assert_no_leak(s)


def _mixed_step_prefill_tokens(s, w, prompts, decoding):
    """Start ``decoding`` requests, queue ``prompts``, run one mixed step; return the prefill tokens it carried."""
    for i in range(decoding):
        s.add_request(_req(f"d{i}", [5 + i, 6, 7], max_new=40, ignore_eos=True))
    s.step()
    assert len(s.running) == decoding
    for i, p in enumerate(prompts):
        s.add_request(_req(f"p{i}", p, max_new=3, ignore_eos=True))
    before = s.allocator.available_size()
    s.step()
    assert w.batch_sizes[-1][0] == "prefill"
    return before - s.allocator.available_size() - decoding


def test_default_mixed_share_grows_when_more_requests_wait_than_decode():
    # CPU default (no --mixed-chunk-prefill-size): base 64 tokens times waiting-per-decoding requests.
    prompts = _prompts(6, seed=8, lo=40, hi=40)
    burst = _sched(w := FakeModelWorker(max_total_num_tokens=2048, vocab_size=VOCAB, max_running_requests=32),
                   device="cpu", chunked_prefill_size=2048)
    assert burst.mixed_chunk_share_adapts and burst.mixed_chunk_prefill_size == 64
    assert _mixed_step_prefill_tokens(burst, w, prompts, decoding=1) == 6 * 40  # share 6 * 64: the whole queue
    trickle = _sched(w := FakeModelWorker(max_total_num_tokens=2048, vocab_size=VOCAB, max_running_requests=32),
                     device="cpu", chunked_prefill_size=2048)
    assert _mixed_step_prefill_tokens(trickle, w, prompts[:2], decoding=4) == 64  # fewer waiting than decoding
    fixed = _sched(w := FakeModelWorker(max_total_num_tokens=2048, vocab_size=VOCAB, max_running_requests=32),
                   device="cpu", chunked_prefill_size=2048, mixed_chunk_prefill_size=64)
    assert not fixed.mixed_chunk_share_adapts
    assert _mixed_step_prefill_tokens(fixed, w, prompts, decoding=1) == 64  # an explicit flag is a fixed share
    for s in (burst, trickle, fixed):
        s.run_until_idle()
        _assert_no_leak(s)


def test_a_batch_message_is_admitted_in_one_prefill_even_while_others_decode():
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w, chunked_prefill_size=64, enable_mixed_chunk=True, mixed_chunk_prefill_size=64)
    prompts = _prompts(4, seed=5, lo=10, hi=10)
    s.handle(BatchTokenizedGenerateReqInput(batch=[_req(f"r{i}", p, max_new=3, ignore_eos=True) for i, p in enumerate(prompts)]))
    outs = s.step()
    assert w.batch_sizes == [("prefill", 4)]
    res = _collect(outs + s.run_until_idle())
    for i, p in enumerate(prompts):
        assert res[f"r{i}"][0] == reference_generate(p, 3, VOCAB, ignore_eos=True)
    _assert_no_leak(s)


def test_mixed_chunk_random_workload():
    rng = random.Random(31)
    w = FakeModelWorker(max_total_num_tokens=64, vocab_size=VOCAB, max_running_requests=6)
    s = _sched(w, chunked_prefill_size=6, enable_mixed_chunk=True, config=SchedulerConfig(init_new_token_ratio=0.05, min_new_token_ratio=0.0))
    prompts, max_news, outs = {}, {}, []
    for step in range(300):
        if step < 100 and rng.random() < 0.3:
            rid = f"r{step}"
            prompts[rid] = _prompts(1, seed=step, lo=2, hi=20)[0]
            max_news[rid] = rng.randint(1, 15)
            s.add_request(_req(rid, prompts[rid], max_new=max_news[rid], stream=True))
        outs += s.step()
    outs += s.run_until_idle()
    res = _collect(outs)
    for rid, p in prompts.items():
        assert res[rid][0] == reference_generate(p, max_news[rid], VOCAB, eos_token_ids=[EOS]), rid
    assert any(kind == "prefill" and bs > 1 for kind, bs in w.batch_sizes)
    _assert_no_leak(s)


def test_return_logprob_needs_a_supporting_worker():
    w = FakeModelWorker(vocab_size=VOCAB)  # the fake computes no logprobs
    s = _sched(w)
    req = _req("lp", [5, 6, 7], max_new=3)
    req.return_logprob = True
    s.add_request(req)
    res = _collect(s.run_until_idle())
    assert res["lp"][1]["type"] == "abort" and "return_logprob" in res["lp"][1]["message"]
    _assert_no_leak(s)


class _StrictTokenizer:
    """tiny_char_tokenizer whose decode refuses a non-bool skip_special_tokens, as HF tokenizers do."""

    def __init__(self):
        self.inner = tiny_char_tokenizer(VOCAB)

    def decode(self, ids, skip_special_tokens=True):
        if not isinstance(skip_special_tokens, bool):
            raise TypeError(f"skip_special_tokens must be a bool, got {skip_special_tokens!r}")
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("page_size,block", [(1, 1), (4, 1), (1, 4), (4, 4)])
def test_a_fault_in_one_requests_finish_checks_fails_it_alone(page_size, block):
    """Regression: skip_special_tokens "no" (below validation) raised in the stop-string check for everyone."""
    w = FakeModelWorker(vocab_size=VOCAB, page_size=page_size, block_size=block)
    s = _sched(w, tokenizer=_StrictTokenizer())
    prompts = _prompts(4, seed=5)
    for i, p in enumerate(prompts):
        s.add_request(_req(f"r{i}", p, max_new=12, ignore_eos=True))
    bad = SamplingParams(max_new_tokens=12, temperature=0.0, stop=["zzz"], skip_special_tokens="no")
    s.add_request(TokenizedGenerateReqInput(rid="bad", input_text=None, input_ids=prompts[0], sampling_params=bad))
    res = _collect(s.run_until_idle())
    reason = res["bad"][1]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "TypeError" in reason["message"]
    for i, p in enumerate(prompts):
        assert res[f"r{i}"][0] == reference_generate(p, 12, VOCAB, ignore_eos=True), i
    _assert_no_leak(s)


def test_an_accelerator_fault_is_a_process_fault():
    """A lost device context is every request's: it propagates (the server then ends as before)."""
    w = FakeModelWorker(vocab_size=VOCAB)
    s = _sched(w)

    def lost_device(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    w.forward_prefill = lost_device
    s.add_request(_req("r0", [5, 6, 7]))
    with pytest.raises(RuntimeError, match="CUDA error"):
        s.run_until_idle()


def test_max_queued_requests_sheds_new_requests_with_a_503_and_serves_the_rest():
    w = FakeModelWorker(page_size=1, vocab_size=VOCAB, max_running_requests=2)
    s = _sched(w, max_queued_requests=3)
    prompts = _prompts(5, seed=9)
    for i, p in enumerate(prompts):  # nothing has stepped yet: all wait, so the 4th and 5th are over the cap
        s.add_request(_req(f"r{i}", p, max_new=6, ignore_eos=True))
    res = _collect(s.run_until_idle())
    for i, p in enumerate(prompts):
        ids, reason, _, _ = res[f"r{i}"]
        if i < 3:
            assert ids == reference_generate(p, 6, VOCAB, ignore_eos=True)
        else:
            assert ids == [] and reason["type"] == "abort" and reason["status_code"] == 503
            assert "--max-queued-requests" in reason["message"]
    _assert_no_leak(s)
