"""DFLASH decoding end to end through the scheduler: lossless against the `dflash` reference.

Greedy: output ids equal `dflash.model.dflash_generate`, target-only greedy decoding and a re-run
of the reference loop that reports per-step acceptance lengths, which must equal ours step by step.
The draft is trained here for a few seconds so acceptance is high but partial.
"""

import contextlib
import logging
import time

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.managers.io_struct import TokenizedGenerateReqInput
from sglite.srt.managers.scheduler import Scheduler
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs
from sglite.srt.speculative.dflash_worker import create_dflash_worker
from sglite.testing.greedy_margin import MIN_GREEDY_MARGIN, assert_clear_greedy_margins
from sglite.testing.tiny_dflash import (
    build_tiny_target,
    load_reference_pair,
    random_prompts,
    train_tiny_draft,
)
from sglite.testing.tiny_dflash import reference_block_generate as _reference_block_generate

SUITE = "unit-cpu"
EST_TIME = 170

BLOCK = 4


def reference_block_generate(*args, **kw):
    """The package's loop re-run, refusing near-ties: ids and per-step lengths are compared exactly."""
    return _reference_block_generate(*args, min_margin=MIN_GREEDY_MARGIN, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("dflash_worker")
    target_dir = build_tiny_target(str(d / "target"), seed=0)
    tr = train_tiny_draft(str(d / "draft"), target_dir, steps=300, seed=0)
    target, draft = load_reference_pair(target_dir, tr.draft_dir)
    return target_dir, tr, target, draft


def spec_args(target_dir, draft_dir, **kw):
    base = dict(
        model_path=target_dir,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=draft_dir,
        dtype="float32",
        device="cpu",
        cpu_kv_cache_budget_mb=4,
        context_length=256,
        max_running_requests=16,
    )
    base.update(kw)
    return ServerArgs(**base).validate()


@contextlib.contextmanager
def spec_scheduler(target_dir, draft_dir, **kw):
    """A Scheduler over a DFlashWorker on a one-rank runtime (torn down afterwards)."""
    args = spec_args(target_dir, draft_dir, **kw)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            worker = create_dflash_worker(args)
            yield Scheduler(args, worker), worker
        finally:
            destroy_parallel_runtime()


@contextlib.contextmanager
def plain_scheduler(target_dir, **kw):
    """The same scheduler over the non-speculative TpModelWorker (sglite without a draft)."""
    from sglite.srt.managers.tp_worker import TpModelWorker

    base = dict(model_path=target_dir, dtype="float32", device="cpu", cpu_kv_cache_budget_mb=4, context_length=256,
                max_running_requests=16)
    base.update(kw)
    args = ServerArgs(**base).validate()
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            yield Scheduler(args, TpModelWorker.create(args))
        finally:
            destroy_parallel_runtime()


class Run:
    """Per-rid output ids, tokens per message (the first is the prefill token) and the last message fields."""

    def __init__(self):
        self.ids: dict[str, list[int]] = {}
        self.steps: dict[str, list[int]] = {}
        self.verify_ct: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.finish: dict[str, object] = {}


def generate(scheduler: Scheduler, prompts, params: list[SamplingParams], rid_prefix="r") -> Run:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"{rid_prefix}{i}", input_text=None, input_ids=list(p), sampling_params=sp, stream=True))
    run = Run()
    for _ in range(10000):
        if not scheduler.sync_dp_groups():  # has_work(), or (DP attention) whether any group has
            break
        for msg in scheduler.step():
            for j, rid in enumerate(msg.rids):
                new = msg.output_ids[j]
                run.ids.setdefault(rid, []).extend(new)
                if new:
                    run.steps.setdefault(rid, []).append(len(new))
                run.verify_ct[rid] = msg.spec_verify_ct[j]
                run.cached[rid] = msg.cached_tokens[j]
                run.finish[rid] = msg.finished_reasons[j]
    assert not scheduler.has_work()
    return run


def greedy(max_new, **kw):
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


@torch.no_grad()
def target_greedy(target, prompt, max_new):
    if max_new == 0:
        return []
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    ids = out[0, len(prompt):].tolist()
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(target, [prompt], [ids])
    return ids


def test_reference_rerun_equals_dflash_generate(trained):
    """The loop re-run that reports per-step lengths is the package's loop (outputs and full-block steps)."""
    import dflash.model as dm

    _, tr, target, draft = trained
    dm._cuda_time = time.perf_counter  # return_stats synchronises CUDA otherwise (platform notes §9)
    for prompt in tr.prompts[:3]:
        ids, lens = reference_block_generate(draft, target, prompt, 21)
        stats = dm.dflash_generate(draft, target, torch.tensor([prompt]), 21, None, return_stats=True)
        assert ids == stats.output_ids[0, len(prompt):].tolist()
        # dflash_generate shrinks the final block to the remaining budget; every other step is a full block.
        full = len(stats.acceptance_lengths) - 1
        assert lens[:full] == stats.acceptance_lengths[:full]


def test_greedy_batch_of_8_matches_reference_per_step(trained):
    target_dir, tr, target, draft = trained
    # 4 prompts on the trajectories the draft was trained on (high acceptance), extended by 0..3 of
    # their own greedy tokens so lengths differ, + 4 unseen prompts (acceptance ~1).
    prompts = [p + target_greedy(target, p, i) for i, p in enumerate(tr.prompts[:4])]
    prompts += random_prompts(4, seed=7, min_len=3, max_len=14)
    max_new = 23
    with spec_scheduler(target_dir, tr.draft_dir) as (sched, worker):
        assert worker.block_size == BLOCK and worker.num_decode_tokens_per_req == BLOCK
        run = generate(sched, prompts, [greedy(max_new)] * len(prompts))
    with plain_scheduler(target_dir) as sched:
        plain = generate(sched, prompts, [greedy(max_new)] * len(prompts))
    all_steps = []
    for i, p in enumerate(prompts):
        ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new)
        import dflash.model as dm

        pkg = dm.dflash_generate(draft, target, torch.tensor([p]), max_new, None)[0, len(p):].tolist()
        ours = run.ids[f"r{i}"]
        assert ours == plain.ids[f"r{i}"] == ref_ids == pkg == target_greedy(target, p, max_new), f"prompt {i}"
        assert run.steps[f"r{i}"][0] == 1  # the prefill token
        assert run.steps[f"r{i}"][1:] == ref_lens, f"prompt {i}: per-step acceptance lengths"
        assert run.verify_ct[f"r{i}"] == len(ref_lens)
        all_steps += ref_lens
    mean = sum(all_steps) / len(all_steps)
    assert 1.4 < mean < BLOCK, f"acceptance should be high but partial, got mean {mean}"
    assert max(all_steps) == BLOCK and min(all_steps) == 1


def test_stop_token_and_max_tokens_inside_a_block(trained):
    target_dir, tr, target, draft = trained
    prompt = tr.prompts[5]
    full = target_greedy(target, prompt, 30)
    stop_tok = full[9]
    first = full.index(stop_tok)
    with spec_scheduler(target_dir, tr.draft_dir) as (sched, _):
        run = generate(sched, [prompt, tr.prompts[6]], [greedy(30, stop_token_ids=[stop_tok]), greedy(13)])
    ref_stop, ref_stop_lens = reference_block_generate(draft, target, prompt, 30, stop_token_ids=[stop_tok])
    assert run.ids["r0"] == full[: first + 1] == ref_stop
    assert run.steps["r0"][1:] == ref_stop_lens
    assert run.finish["r0"]["type"] == "stop"
    ref13, lens13 = reference_block_generate(draft, target, tr.prompts[6], 13)
    assert run.ids["r1"] == ref13 and len(ref13) == 13
    assert run.steps["r1"][1:] == lens13
    assert run.finish["r1"]["type"] == "length"


def test_radix_prefix_keeps_draft_kv_valid(trained):
    """A second request whose prompt extends a finished one reuses its cached slots (target + draft KV)."""
    target_dir, tr, target, draft = trained
    base = tr.prompts[7]
    with spec_scheduler(target_dir, tr.draft_dir) as (sched, _):
        first = generate(sched, [base], [greedy(12)], rid_prefix="a")
        extended = base + first.ids["a0"][:8]  # a prefix that the cache holds with K/V
        second = generate(sched, [extended], [greedy(16)], rid_prefix="b")
    assert second.cached["b0"] >= len(base)
    ref_ids, ref_lens = reference_block_generate(draft, target, extended, 16)
    assert second.ids["b0"] == ref_ids
    assert second.steps["b0"][1:] == ref_lens
    # The same request without a cache agrees.
    with spec_scheduler(target_dir, tr.draft_dir, disable_radix_cache=True) as (sched, _):
        nc = generate(sched, [extended], [greedy(16)], rid_prefix="c")
    assert nc.ids["c0"] == second.ids["b0"] and nc.cached["c0"] == 0


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value over cells with expected count >= 5 (the rest pooled into one cell)."""
    n = observed.sum().double()
    expected = expected_probs.double() * n
    keep = expected >= 5
    obs = torch.cat([observed.double()[keep], (n - observed.double()[keep].sum()).reshape(1)])
    exp = torch.cat([expected[keep], (n - expected[keep].sum()).reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2.0, dtype=torch.float64), stat / 2.0))


def _anchor_dspark(tr, tmp_path, **kw):
    """A DSPARK draft in the released convention (sample_from_anchor: B drafts, B+1 verified) with a confidence head."""
    from sglite.testing.tiny_dflash import build_tiny_dspark_draft

    return build_tiny_dspark_draft(
        str(tmp_path / "dspark_anchor"), tr.draft_dir, markov_rank=8, markov_scale=0.5, markov_head_type="rnn",
        enable_confidence_head=True, confidence_head_with_markov=True, sample_from_anchor=True, **kw,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ["DFLASH", "DSPARK"])
def test_sampling_temperature_1_matches_target_distribution(trained, tmp_path, algo):
    """Over many seeds the first two generated tokens follow the target-only distribution (chi-square).

    DSPARK: the released convention (B drafts per block) under cap-accept verification.
    """
    target_dir, tr, target, _ = trained
    draft_dir = tr.draft_dir if algo == "DFLASH" else _anchor_dspark(tr, tmp_path)
    extra = {} if algo == "DFLASH" else dict(speculative_algorithm="DSPARK", ragged_verify_mode="cap-accept")
    prompt = tr.prompts[0]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        seqs = torch.cat([torch.tensor([prompt]).expand(p1.numel(), -1), torch.arange(p1.numel())[:, None]], dim=1)
        p2_given_1 = torch.softmax(target(seqs).logits[:, -1].double(), -1)
    p2 = p1 @ p2_given_1  # marginal of the second generated token

    n = 1500
    with spec_scheduler(target_dir, draft_dir, max_running_requests=64, cpu_kv_cache_budget_mb=16, **extra) as (sched, worker):
        accepted, verified = [], []
        orig = worker.forward_decode

        def recording(batch):
            out = orig(batch)
            accepted.extend(worker.last_step.accept_lens)
            verified.append(worker.last_step.verified_drafts)
            return out

        worker.forward_decode = recording
        params = [SamplingParams(max_new_tokens=2, temperature=1.0, seed=1000 + i) for i in range(n)]
        run = generate(sched, [prompt] * n, params)
    first = torch.tensor([run.ids[f"r{i}"][0] for i in range(n)])
    second = torch.tensor([run.ids[f"r{i}"][1] for i in range(n)])
    assert chi_square_pvalue(torch.bincount(first, minlength=p1.numel()), p1) > 1e-3
    assert chi_square_pvalue(torch.bincount(second, minlength=p2.numel()), p2) > 1e-3
    # Both verification paths ran: some first drafts were accepted and some rejected.
    first_draft_accepted = sum(1 for a in accepted if a >= 1)
    assert 0 < first_draft_accepted < len(accepted)
    if algo == "DSPARK":
        assert min(verified) < worker.num_proposed_drafts  # the cap cut some blocks


def _tp_rank_main(rank: int, world_size: int, init_method: str, target_dir: str, draft_dir: str, prompts, max_new,
                  token_map=None):
    args = spec_args(target_dir, draft_dir, tp_size=world_size, speculative_token_map=token_map)
    worker = create_dflash_worker(args, rank=rank, world_size=world_size, dist_init_method=init_method)
    # Greedy requests, then the same prompts sampled at temperature 1 (ranks must agree on every draw).
    params = [greedy(max_new)] * len(prompts)
    params += [SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=50 + i) for i in range(len(prompts))]
    run = generate(Scheduler(args, worker), prompts + prompts, params)
    attn = worker.draft_model.layers[0].self_attn
    return {
        "ids": run.ids,
        "steps": run.steps,
        "draft_local_heads": (attn.num_heads, attn.num_kv_heads),
        "draft_pool_heads": worker.draft_runner.token_to_kv_pool.head_num,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("token_map", [False, True], ids=["full_head", "shuffled_full_token_map"])
def test_greedy_tp2_matches_reference(trained, tmp_path, token_map):
    """With a token map of the whole vocabulary in shuffled order, every rank gathers the hot head's rows
    from both vocabulary shards and maps columns back to ids: the drafts, so every step, stay the reference's."""
    from sglite.srt.distributed.local_launch import run_local_ranks

    target_dir, tr, target, draft = trained
    prompts = [tr.prompts[1], tr.prompts[2] + target_greedy(target, tr.prompts[2], 2)] + random_prompts(1, seed=3)
    max_new = 17
    map_path = shuffled_token_map(tmp_path, target.config.vocab_size) if token_map else None
    results = run_local_ranks(_tp_rank_main, 2, target_dir, tr.draft_dir, prompts, max_new, map_path, timeout_s=240)
    for res in results:
        assert res["draft_local_heads"] == (2, 1) and res["draft_pool_heads"] == 1  # sharded over 2 ranks
        for i, p in enumerate(prompts):
            ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new)
            assert res["ids"][f"r{i}"] == ref_ids
            assert res["steps"][f"r{i}"][1:] == ref_lens
    assert any(max(res["steps"][f"r{i}"][1:]) > 1 for i in range(len(prompts)) for res in results)
    n = len(prompts)
    assert [results[0]["ids"][f"r{n + i}"] for i in range(n)] == [results[1]["ids"][f"r{n + i}"] for i in range(n)]


def test_dspark_greedy_is_lossless_and_zeroed_head_equals_dflash(trained, tmp_path):
    from sglite.testing.tiny_dflash import build_tiny_dspark_draft

    target_dir, tr, target, draft = trained
    # sample_from_anchor=False: the DFlash slot convention, so a zeroed head drafts exactly like DFLASH.
    zero_dir = build_tiny_dspark_draft(
        str(tmp_path / "dspark0"), tr.draft_dir, markov_rank=8, markov_scale=0.0, sample_from_anchor=False
    )
    markov_dir = build_tiny_dspark_draft(
        str(tmp_path / "dspark"), tr.draft_dir, markov_rank=8, markov_scale=1.0, sample_from_anchor=False
    )
    prompts = [tr.prompts[3], tr.prompts[8] + target_greedy(target, tr.prompts[8], 1)] + random_prompts(1, seed=11)
    max_new = 19
    with spec_scheduler(target_dir, zero_dir, speculative_algorithm="DSPARK") as (sched, worker):
        assert type(worker.draft_model).__name__ == "DSparkDraftModel"
        zero = generate(sched, prompts, [greedy(max_new)] * len(prompts))
    with spec_scheduler(target_dir, markov_dir, speculative_algorithm="DSPARK") as (sched, _):
        markov = generate(sched, prompts, [greedy(max_new)] * len(prompts))
    for i, p in enumerate(prompts):
        ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new)
        assert zero.ids[f"r{i}"] == markov.ids[f"r{i}"] == ref_ids == target_greedy(target, p, max_new)
        assert zero.steps[f"r{i}"][1:] == ref_lens  # zeroed Markov head: exactly the DFLASH drafts


def test_dspark_anchor_convention_is_lossless_and_cap_accept_verifies_less(trained, tmp_path):
    """B drafts and B+1 verified tokens per block; cap-accept trims the verify yet keeps the target's output."""
    target_dir, tr, target, _ = trained
    draft_dir = _anchor_dspark(tr, tmp_path)
    prompts = [tr.prompts[5], tr.prompts[6] + target_greedy(target, tr.prompts[6], 2)] + random_prompts(1, seed=12)
    max_new = 17
    runs, verified = {}, {}
    for mode in ("static", "cap-accept"):
        with spec_scheduler(target_dir, draft_dir, speculative_algorithm="DSPARK", ragged_verify_mode=mode,
                            ragged_verify_cap_threshold=0.3) as (sched, worker):
            assert (worker.block_size, worker.num_proposed_drafts, worker.num_decode_tokens_per_req) == (
                BLOCK, BLOCK, BLOCK + 1)
            steps = []
            orig = worker.forward_decode

            def recording(batch, orig=orig, steps=steps, worker=worker):
                out = orig(batch)
                steps.append(worker.last_step.verified_drafts)
                return out

            worker.forward_decode = recording
            runs[mode] = generate(sched, prompts, [greedy(max_new)] * len(prompts))
            verified[mode] = steps
    for i, p in enumerate(prompts):
        assert runs["static"].ids[f"r{i}"] == runs["cap-accept"].ids[f"r{i}"] == target_greedy(target, p, max_new)
    assert set(verified["static"]) == {BLOCK}
    assert min(verified["cap-accept"]) < BLOCK and sum(verified["cap-accept"]) < sum(verified["static"])


def test_cap_accept_needs_a_confidence_head(trained, tmp_path):
    from sglite.testing.tiny_dflash import build_tiny_dspark_draft

    target_dir, tr, _, _ = trained
    no_head = build_tiny_dspark_draft(str(tmp_path / "no_conf"), tr.draft_dir, markov_rank=8)
    with pytest.raises(ValueError, match="confidence head"):
        with spec_scheduler(target_dir, no_head, speculative_algorithm="DSPARK", ragged_verify_mode="cap-accept"):
            pass


def test_algorithm_must_match_the_draft_checkpoint(trained):
    target_dir, tr, _, _ = trained
    with pytest.raises(ValueError, match="DSPARK"):
        with spec_scheduler(target_dir, tr.draft_dir, speculative_algorithm="DSPARK"):
            pass


def test_page_size_4_and_eos_inside_a_block(trained):
    """Paged KV (rejected slots freed page-wise by the scheduler) and an EOS id hit mid-block."""
    target_dir, tr, target, draft = trained
    prompts = [tr.prompts[9], tr.prompts[10] + target_greedy(target, tr.prompts[10], 3)]
    max_new = 21
    eos = target_greedy(target, prompts[1], max_new)[11]
    args = spec_args(target_dir, tr.draft_dir, page_size=4)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            sched = Scheduler(args, create_dflash_worker(args), eos_token_ids=[eos])
            free_before = sched.allocator.available_size()
            run = generate(sched, prompts, [greedy(max_new)] * len(prompts))
            # Everything the requests held is back in the allocator or the prefix cache.
            assert sched.allocator.available_size() + sched.tree_cache.total_size() == free_before
        finally:
            destroy_parallel_runtime()
    for i, p in enumerate(prompts):
        ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new, stop_token_ids=[eos])
        assert run.ids[f"r{i}"] == ref_ids
        assert run.steps[f"r{i}"][1:] == ref_lens
    assert run.finish["r1"]["type"] == "stop"


def test_stop_string_inside_a_block_matches_plain_decoding(trained, tmp_path):
    from transformers import AutoTokenizer

    from sglite.testing.tiny_tokenizer import build_tiny_tokenizer

    target_dir, tr, target, _ = trained
    build_tiny_tokenizer(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt = tr.prompts[11]
    max_new = 24
    full = target_greedy(target, prompt, max_new)
    stop = next(s for s in (tok.decode(full[k : k + 2]) for k in range(9, 20)) if s.strip())
    params = [SamplingParams(max_new_tokens=max_new, temperature=0.0, stop=[stop])]
    args = spec_args(target_dir, tr.draft_dir)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            spec = generate(Scheduler(args, create_dflash_worker(args), tokenizer=tok), [prompt], params)
        finally:
            destroy_parallel_runtime()
    plain_args = ServerArgs(model_path=target_dir, dtype="float32", device="cpu", cpu_kv_cache_budget_mb=4,
                            context_length=256).validate()
    from sglite.srt.managers.tp_worker import TpModelWorker

    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            plain = generate(Scheduler(plain_args, TpModelWorker.create(plain_args), tokenizer=tok), [prompt], params)
        finally:
            destroy_parallel_runtime()
    assert spec.ids["r0"] == plain.ids["r0"] == full[: len(plain.ids["r0"])]
    assert len(spec.ids["r0"]) < max_new and spec.finish["r0"]["type"] == "stop"
    assert stop in tok.decode(spec.ids["r0"])


def test_chunked_prefill_and_mixed_greedy_sampled_batch(trained):
    """Draft KV written chunk by chunk is as good as one prefill; sampled neighbours do not disturb greedy rows."""
    target_dir, tr, target, draft = trained
    greedy_prompts = [tr.prompts[12] + target_greedy(target, tr.prompts[12], 5), tr.prompts[13]]
    sampled_prompts = [tr.prompts[14], random_prompts(1, seed=5)[0]]
    max_new = 18
    params = [greedy(max_new)] * 2 + [SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=s) for s in (1, 2)]
    with spec_scheduler(target_dir, tr.draft_dir, chunked_prefill_size=4) as (sched, _):
        run = generate(sched, greedy_prompts + sampled_prompts, params)
        assert sched.num_prefill_forwards >= 4  # prompts of 15 and 10 tokens went through 4-token chunks
    for i, p in enumerate(greedy_prompts):
        ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new)
        assert run.ids[f"r{i}"] == ref_ids
        assert run.steps[f"r{i}"][1:] == ref_lens
    for i in (2, 3):
        assert len(run.ids[f"r{i}"]) == max_new


def test_num_draft_tokens_flag_overrides_the_checkpoint_block(trained, caplog):
    target_dir, tr, target, draft = trained
    prompts = [tr.prompts[15], tr.prompts[4] + target_greedy(target, tr.prompts[4], 2)]
    max_new = 15
    caplog.set_level(logging.INFO, logger="sglite.srt.speculative.dflash_worker")
    with spec_scheduler(target_dir, tr.draft_dir, speculative_num_draft_tokens=3) as (sched, worker):
        assert worker.block_size == 3 and worker.num_decode_tokens_per_req == 3
        run = generate(sched, prompts, [greedy(max_new)] * len(prompts))
    # A narrower block is the draft's first slots as trained (the bundled draft's CPU default): no warning.
    narrower = [r for r in caplog.records if "draft block size 3" in r.getMessage()]
    assert [r.levelno for r in narrower] == [logging.INFO]
    caplog.clear()
    with spec_scheduler(target_dir, tr.draft_dir, speculative_num_draft_tokens=BLOCK + 2):
        pass
    wider = [r for r in caplog.records if f"draft block size {BLOCK + 2}" in r.getMessage()]
    assert [r.levelno for r in wider] == [logging.WARNING]
    for i, p in enumerate(prompts):
        ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new, block_size=3)
        assert run.ids[f"r{i}"] == ref_ids
        assert run.steps[f"r{i}"][1:] == ref_lens and max(ref_lens) <= 3


def _dp_attention_rank_main(rank: int, world_size: int, init_method: str, target_dir: str, draft_dir: str, prompts, max_new):
    args = spec_args(target_dir, draft_dir, tp_size=2, dp_size=2, enable_dp_attention=True)
    worker = create_dflash_worker(args, rank=rank, world_size=world_size, dist_init_method=init_method)
    # Each attention-DP rank serves its own requests with a whole replica (attn_tp 1).
    scheduler = Scheduler(args, worker)
    run = generate(scheduler, prompts[rank :: 2], [greedy(max_new)] * len(prompts[rank :: 2]))
    attn = worker.draft_model.layers[0].self_attn
    target = worker.target_model
    return {
        # SGLang's split: target attention per attention-DP group (attn_tp 1), MLP and LM head over tp 2.
        "target_attn_heads": target.model.layers[0].self_attn.num_heads,
        "target_mlp_rows": target.model.layers[0].mlp.gate_up_proj.weight.shape[0],
        "lm_head_rows": target.lm_head.weight.shape[0],
        "idle_forwards": scheduler.num_idle_forwards,
        "ids": [run.ids[f"r{i}"] for i in range(len(prompts[rank :: 2]))],
        "steps": [run.steps[f"r{i}"] for i in range(len(prompts[rank :: 2]))],
        "draft_local_heads": (attn.num_heads, attn.num_kv_heads),
        "draft_pool_heads": worker.draft_runner.token_to_kv_pool.head_num,
    }


@pytest.mark.timeout(300)
def test_dp_attention_draft_is_sharded_at_attn_tp(trained):
    """tp 2 / dp 2 with DP attention: attn_tp is 1, so each rank keeps every draft head (and prices them)."""
    from sglite.srt.distributed.local_launch import run_local_ranks

    target_dir, tr, target, draft = trained
    prompts = [tr.prompts[0], tr.prompts[1], random_prompts(1, seed=21)[0]]
    max_new = 13
    results = run_local_ranks(_dp_attention_rank_main, 2, target_dir, tr.draft_dir, prompts, max_new, timeout_s=240)
    hf = target.config
    for rank, res in enumerate(results):
        assert res["draft_local_heads"] == (4, 2) and res["draft_pool_heads"] == 2
        assert res["target_attn_heads"] == hf.num_attention_heads
        assert res["target_mlp_rows"] == 2 * hf.intermediate_size // 2  # gate + up rows, split over tp 2
        assert res["lm_head_rows"] == -(-hf.vocab_size // 2)
        for ids, steps, p in zip(res["ids"], res["steps"], prompts[rank::2]):
            ref_ids, ref_lens = reference_block_generate(draft, target, p, max_new)
            assert ids == ref_ids and steps[1:] == ref_lens
    # Rank 1 has one request, rank 0 two: rank 1 keeps stepping (IDLE) while rank 0 finishes.
    assert results[1]["idle_forwards"] > 0


def test_retraction_under_kv_pressure_stays_lossless(trained):
    """A pool too small for every running request forces retraction; re-prefill rebuilds the draft context KV."""
    target_dir, tr, target, draft = trained
    prompts = [p + target_greedy(target, p, i % 3) for i, p in enumerate(tr.prompts[:6])]
    max_new = 24
    with spec_scheduler(target_dir, tr.draft_dir, max_total_tokens=110) as (sched, _):
        run = generate(sched, prompts, [greedy(max_new)] * len(prompts))
        assert sched.num_retractions > 0
    for i, p in enumerate(prompts):
        assert run.ids[f"r{i}"] == reference_block_generate(draft, target, p, max_new)[0]
    # Drafting still works after re-prefill (trained trajectories keep accepting several tokens per step).
    decode_tokens = sum(len(run.ids[f"r{i}"]) for i in range(len(prompts)))
    assert decode_tokens / sum(run.verify_ct.values()) > 1.4


def generate_with_logprobs(sched, prompts, params, rid_prefix):
    """Run requests with return_logprob to the end; per-rid output ids and their logprobs."""
    ids: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sched.add_request(TokenizedGenerateReqInput(
            rid=f"{rid_prefix}{i}", input_text=None, input_ids=list(p), sampling_params=sp, stream=True, return_logprob=True))
    while sched.has_work():
        for msg in sched.step():
            for j, rid in enumerate(msg.rids):
                ids.setdefault(rid, []).extend(msg.output_ids[j])
                lps.setdefault(rid, []).extend(msg.output_token_logprobs[j])
    return ids, lps


def assert_target_logprobs(target, prompt, out, lps):
    """lps equal transformers' teacher-forced log-softmax (raw logits) of out after prompt."""
    with torch.no_grad():
        logits = target(torch.tensor([list(prompt) + out])).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=0)


def test_logprobs_of_accepted_tokens_equal_the_targets_own(trained):
    """return_logprob on a DFLASH worker: every returned token (accepted drafts and bonus) carries log p under
    the target (raw logits), equal to transformers' teacher-forced log-softmax of the same sequence."""
    target_dir, tr, target, draft = trained
    prompts = [tr.prompts[0], tr.prompts[2]]
    params = [greedy(20), SamplingParams(max_new_tokens=20, temperature=0.8, seed=7)]
    with spec_scheduler(target_dir, tr.draft_dir) as (sched, _):
        ids, lps = generate_with_logprobs(sched, prompts, params, "lp")
        verify_ct = sched.spec_verify_total
    assert verify_ct < sum(len(v) for v in ids.values())  # drafts were accepted, so blocks returned several tokens
    for i, p in enumerate(prompts):
        out = ids[f"lp{i}"]
        assert len(out) == 20 and len(lps[f"lp{i}"]) == 20
        assert_target_logprobs(target, p, out, lps[f"lp{i}"])


def test_spec_cap_length_in_meta_info_only_when_blocks_were_trimmed(trained, tmp_path):
    """cap-accept: the scheduler reports the mean drafts verified per step; static reports nothing."""
    target_dir, tr, _, _ = trained
    draft_dir = _anchor_dspark(tr, tmp_path)
    for mode in ("static", "cap-accept"):
        with spec_scheduler(target_dir, draft_dir, speculative_algorithm="DSPARK", ragged_verify_mode=mode,
                            ragged_verify_cap_threshold=0.3) as (sched, worker):
            sched.add_request(TokenizedGenerateReqInput(rid="c", input_text=None, input_ids=tr.prompts[7],
                                                        sampling_params=greedy(12), stream=False))
            msgs = []
            while sched.has_work():
                msgs.extend(sched.step())
            (last,) = [m for m in msgs if m.finished_reasons[0] is not None]
            cap = last.spec_cap_length[0]
            if mode == "static":
                assert cap is None
            else:
                assert cap is not None and 1 <= cap < worker.num_proposed_drafts


@pytest.mark.parametrize("buffer_rows", [None, 5, 2])
def test_disable_by_batch_size_crosses_both_ways_and_stays_lossless(trained, monkeypatch, buffer_rows):
    """Drafting stops while >= 3 requests decode and resumes after; the draft's context KV stays complete.

    A long request drafts alone, three short ones join (plain target steps: one token each, no drafts),
    they finish and A drafts again. Every output equals target-only greedy decoding, and from the step
    A resumes drafting its per-step acceptance lengths equal the reference loop started fresh on A's
    tokens before its anchor: proof that the plain steps wrote the draft context K/V the resumed draft reads.
    With a small deferred context buffer the 4-row steps take the other paths: 5 rows flush the waiting
    rows before a step that would not fit; 2 rows are fewer than one step, which writes its rows at once.
    """
    import sglite.srt.model_executor.pool_configurator as pc

    if buffer_rows is not None:
        monkeypatch.setattr(pc, "MAX_DEFERRED_CONTEXT_ROWS", buffer_rows)
    target_dir, tr, target, draft = trained
    prompt_a = tr.prompts[0]
    others = random_prompts(3, seed=11, min_len=3, max_len=10)
    waiting = []  # deferred rows before each step
    with spec_scheduler(target_dir, tr.draft_dir, speculative_disable_by_batch_size=3) as (sched, worker):
        assert worker.deferred_context.capacity == (buffer_rows or 256)
        widths = []  # (batch size, slots a request) per decode step
        decode = worker.forward_decode
        worker.forward_decode = lambda batch: widths.append((batch.batch_size, set(batch.extend_lens))) or decode(batch)
        sched.add_request(TokenizedGenerateReqInput(rid="a", input_text=None, input_ids=list(prompt_a),
                                                    sampling_params=greedy(40), stream=True))
        ids: dict[str, list[int]] = {}
        a_steps: list[tuple[int, bool, int]] = []  # (A's tokens before the step, drafted?, tokens returned)
        for n in range(10000):
            if n == 3:
                for i, p in enumerate(others):
                    sched.add_request(TokenizedGenerateReqInput(rid=f"o{i}", input_text=None, input_ids=list(p),
                                                                sampling_params=greedy(6), stream=True))
            if not sched.has_work():
                break
            before = len(ids.get("a", []))
            worker.last_step = None
            waiting.append(worker.deferred_context.size)
            for msg in sched.step():
                for j, rid in enumerate(msg.rids):
                    ids.setdefault(rid, []).extend(msg.output_ids[j])
            if worker.last_step is not None and len(ids.get("a", [])) > before:
                drafted = any(len(d) > 0 for d in worker.last_step.draft_ids)
                a_steps.append((before, drafted, len(ids["a"]) - before))
    assert ids["a"] == target_greedy(target, prompt_a, 40)
    for i, p in enumerate(others):
        assert ids[f"o{i}"] == target_greedy(target, p, 6)
    # Rows wait in whole steps: several in the default buffer, one in 5 rows (two 4-row steps would overflow
    # it: the second flushes first), none in 2 (a step writes its own rows at once).
    assert {None: max(waiting) >= 8, 5: 0 < max(waiting) <= 4, 2: max(waiting) == 0}[buffer_rows], waiting
    kinds = [d for _, d, _ in a_steps]
    off = kinds.index(False)
    back = off + kinds[off:].index(True)
    assert any(kinds[:off]) and not any(kinds[off:back]) and all(kinds[back:]), kinds
    assert all(n == 1 for _, d, n in a_steps if not d)
    # A draft-free step is allocated one slot a request, a drafted one the verify width.
    assert {bs >= 3 for bs, _ in widths} == {True, False}
    assert all(w == {1 if bs >= 3 else worker.num_decode_tokens_per_req} for bs, w in widths), widths
    # The resumed step's anchor is A's newest token; the reference prefills up to it and emits it first.
    start = a_steps[back][0] - 1
    _, ref_lens = reference_block_generate(draft, target, list(prompt_a) + ids["a"][:start], 40 - start)
    assert [n for _, _, n in a_steps[back:]] == ref_lens
    assert max(ref_lens) > 1  # the resumed draft is accepted, not just lossless


class ScriptedPolicy:
    """Stands in for AdaptiveSpeculation: a fixed pattern of step kinds (True: drafted, False: draft-free, or a
    StepKind), and the steps and shadow scores reported back."""

    def __init__(self, pattern, off=False):
        self.pattern, self.asked, self.records, self.off = pattern, 0, [], off
        self.shadows, self.shadow_scores = [], []

    def drafting_off(self, batch_size):
        return self.off

    def next_step(self, batch_size):
        from sglite.srt.speculative.adaptive import StepKind

        self.asked += 1
        kind = self.pattern[(self.asked - 1) % len(self.pattern)]
        return kind if isinstance(kind, StepKind) else StepKind.DRAFTED if kind else StepKind.PLAIN

    def record(self, batch_size, drafted, seconds, tokens_per_req):
        self.records.append((batch_size, drafted, seconds, tokens_per_req))

    def record_shadow(self, batch_size, seconds):
        self.shadows.append((batch_size, seconds))

    def record_shadow_accept(self, batch_size, tokens_per_req, num_requests):
        self.shadow_scores.append((batch_size, tokens_per_req, num_requests))


def test_adaptive_steps_through_both_paths_stay_lossless(trained, caplog):
    """--speculative-adaptive: whichever path the policy picks, greedy output is the target's, logprobs are the
    target's own (greedy and sampled rows), the policy hears each step's kind, time and committed tokens, and
    the server's accept length counts drafted steps only (the "Decode batch." line adds the draft-free share)."""
    import logging
    import re

    from sglite.srt.speculative.adaptive import AdaptiveSpeculation

    target_dir, tr, target, _ = trained
    prompts = [tr.prompts[0], tr.prompts[1], tr.prompts[2]]
    params = [greedy(24), greedy(24), SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)]
    caplog.set_level(logging.INFO, logger="sglite.srt.managers.scheduler")
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True, decode_log_interval=5) as (sched, worker):
        assert isinstance(worker.adaptive, AdaptiveSpeculation)
        policy = worker.adaptive = ScriptedPolicy([True, False, False, True, False])
        widths = []  # slots a request per decode step: W drafted, 1 draft-free (contiguous K/V, nothing freed)
        decode = worker.forward_decode
        worker.forward_decode = lambda batch: widths.append(set(batch.extend_lens)) or decode(batch)
        ids, lps = generate_with_logprobs(sched, prompts, params, "a")
        steps = (sched.spec_drafted_steps, sched.spec_draft_free_steps)
        verify_total, accepted_total = sched.spec_verify_total, sched.spec_accepted_total
    for i in (0, 1):
        assert ids[f"a{i}"] == target_greedy(target, prompts[i], 24)
    for i, p in enumerate(prompts):
        out = ids[f"a{i}"]
        assert len(out) == len(lps[f"a{i}"]) == 24
        assert_target_logprobs(target, p, out, lps[f"a{i}"])
    drafted = [r for r in policy.records if r[1]]
    free = [r for r in policy.records if not r[1]]
    assert len(policy.records) == policy.asked and steps == (len(drafted), len(free)) and drafted and free
    assert widths == [{worker.num_decode_tokens_per_req if d else 1} for _, d, _, _ in policy.records], widths
    assert all(s > 0 for _, _, s, _ in policy.records)
    assert all(t == 1.0 for *_, t in free) and all(t >= 1.0 for *_, t in drafted)
    assert max(t for *_, t in drafted) > 1.0  # the trained draft is accepted on the drafted steps
    # Per request, only drafted steps count toward the accept length, which is then > 1.
    assert verify_total == sum(bs for bs, *_ in drafted) and accepted_total > verify_total
    decode = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert decode and all(re.search(r", accept len: \d+\.\d\d, draft-free steps: 3/5, gen throughput", m) for m in decode), decode


def test_a_shadow_step_scores_its_drafts_as_a_verify_would_and_stays_lossless(trained):
    """A shadow step (the cost model's cheap probe of a draft-free bucket) runs the draft block, returns the
    target's one token like a draft-free step (W slots allocated, W - 1 freed, K/V complete for a later block), and
    scores its drafts once the request's next tokens are out: at every position where an always-drafting run
    verified a block, the score equals the tokens that verify committed."""
    from sglite.srt.speculative.adaptive import StepKind

    target_dir, tr, target, _ = trained
    prompts = [tr.prompts[0], tr.prompts[2]]
    with spec_scheduler(target_dir, tr.draft_dir) as (sched, worker):  # always drafting
        verified = {}  # (request, output length before the step) -> tokens the verify committed
        decode = worker.forward_decode

        def spy(batch):
            before = [(r.rid, len(r.output_ids)) for r in batch.reqs]
            out = decode(batch)
            verified.update({key: len(toks) for key, toks in zip(before, out)})
            return out

        worker.forward_decode = spy
        generate(sched, prompts, [greedy(24), greedy(24)])
    # Shadow steps throughout (then a drafted step, which reads the context the shadow steps deferred).
    pattern = [StepKind.SHADOW] * 20 + [True]
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True) as (sched, worker):
        policy = worker.adaptive = ScriptedPolicy(pattern)
        widths, scored = [], {}
        decode, score = worker.forward_decode, worker._score_shadow_probes

        def spy_decode(batch):
            widths.append(set(batch.extend_lens))
            return decode(batch)

        def spy_score():
            for probe in worker.shadow_probes:  # what each waiting probe's requests would score now
                for r, start, n in zip(probe.reqs, probe.starts, probe.scored()):
                    if n is not None:
                        scored[(r.rid, start)] = n
            score()

        worker.forward_decode, worker._score_shadow_probes = spy_decode, spy_score
        run = generate(sched, prompts, [greedy(24), greedy(24)])
        # The W - 1 unkept slots of every shadow step came back: after a cache flush every slot is free.
        assert sched.flush_cache().success and sched.allocator.available_size() == sched.initial_free_slots
    for i, p in enumerate(prompts):
        assert run.ids[f"r{i}"] == target_greedy(target, p, 24)
    assert policy.shadows and all(w == {worker.num_decode_tokens_per_req} for w in widths)
    # A shadow step commits one token per request; it counts as draft-free.
    assert sched.spec_drafted_steps == sum(1 for k in policy.records if k[1]) > 0
    same = [(key, n, verified[key]) for key, n in scored.items() if key in verified]
    assert len(same) >= 4 and all(n == v for _, n, v in same), same
    assert max(n for _, n, _ in same) > 1  # the trained draft's shadows find accepted drafts
    # What the policy heard: per shadow step, the mean over its requests, counting the requests scored.
    assert policy.shadow_scores and all(bs >= n >= 1 and t >= 1.0 for bs, t, n in policy.shadow_scores)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_a_q8_0_draft_reads_its_blocks_and_stays_lossless(trained, monkeypatch, native_bf16):
    """--speculative-draft-model-quantization q8_0: the draft's linears carry Q8_0 blocks the GGUF kernel reads at
    decode sizes (beside an fp32 target that has none), greedy output is still the target's, and the rounded
    draft is still accepted. Where the CPU has bf16 dot products, its wide context writes also project in bf16."""
    from sglite.srt.layers.cpu_gemm import available_pack_layouts
    from sglite.srt.layers.cpu_gguf_linear import gguf_kernel_available
    from sglite.srt.model_executor import model_runner

    if not gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    if native_bf16 and "onednn" not in available_pack_layouts(torch.bfloat16):
        pytest.skip("this torch build packs no bf16 weights")
    monkeypatch.setattr(model_runner, "bf16_gemm_is_native", lambda: native_bf16)  # (emulated where it is not)
    target_dir, tr, target, _ = trained
    prompts = [tr.prompts[0], tr.prompts[2]]
    with spec_scheduler(target_dir, tr.draft_dir, speculative_draft_model_quantization="q8_0") as (sched, worker):
        draft_linears = [m for m in worker.draft_model.modules() if getattr(m, "packed_weight", None) is not None]
        target_linears = [m for m in worker.target_model.modules() if getattr(m, "packed_weight", None) is not None]
        projections = [worker.draft_model.fc_bf16] + [la.self_attn.context_kv_bf16 for la in worker.draft_model.layers]
        run = generate(sched, prompts, [greedy(24), greedy(24)])
        verify_total, accepted_total = sched.spec_verify_total, sched.spec_accepted_total
    assert all(p is not None for p in projections) if native_bf16 else all(p is None for p in projections)
    assert draft_linears and all(m.packed_weight.gguf.type_name == "Q8_0" for m in draft_linears)
    assert all(m.packed_weight.gguf_rows for m in draft_linears)
    assert target_linears and all(m.packed_weight.gguf is None for m in target_linears)
    for i, p in enumerate(prompts):
        assert run.ids[f"r{i}"] == target_greedy(target, p, 24)
    assert accepted_total > 1.5 * verify_total  # the trained draft, rounded, is still accepted


def test_adaptive_policy_measures_and_stays_lossless(trained):
    """The real cost model on the toy pair, uncalibrated: it warms a bucket up (drafted, then draft-free steps),
    greedy is exact."""
    from sglite.srt.speculative.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation

    target_dir, tr, target, _ = trained
    prompts = [tr.prompts[0], tr.prompts[3]]
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True) as (sched, worker):
        worker.adaptive = AdaptiveSpeculation(AdaptiveSpecConfig(calibrate_max_batch_size=0))
        run = generate(sched, prompts, [greedy(30), greedy(30)])
        buckets = worker.adaptive.buckets
    for i, p in enumerate(prompts):
        assert run.ids[f"r{i}"] == target_greedy(target, p, 30)
    # The first bucket measures both kinds of step. A bucket the traffic reaches later (one request left)
    # may instead start with the choice its timed neighbours settle, which depends on the timings; it then
    # records the steps it runs, and may not have warmed up before the run ends.
    assert any(b.draft_warmup and b.plain_warmup and b.prior is None for b in buckets.values()), buckets
    for b in buckets.values():
        assert b.draft_warmup or b.plain_warmup, buckets
        assert b.prior is None or set(b.prior.sources) <= set(buckets), buckets
    assert sched.spec_drafted_steps >= 3 and sched.spec_draft_free_steps >= 1


def _kv_buffers(worker):
    """Copies of every K and V buffer of the target and draft pools."""
    pools = (worker.target_runner.token_to_kv_pool, worker.draft_runner.token_to_kv_pool)
    return [t.clone() for pool in pools for t in pool.buffers()]


def test_adaptive_policy_starts_calibrated_leaves_nothing_behind_and_stays_lossless(trained, caplog):
    """Start-up calibration: each batch-size bucket the server can reach (max_running_requests 16: buckets 1 to 16)
    times both kinds of step on dummy batches and starts warm. It touches no K/V but the padding slot's, holds no
    slot, request row or deferred row afterwards, and the server then decides without measuring steps; greedy is
    exact."""
    import logging

    from sglite.srt.speculative.step_calibration import calibration_batch_sizes

    target_dir, tr, target, _ = trained
    prompts = [tr.prompts[0], tr.prompts[3]]
    caplog.set_level(logging.INFO, logger="sglite.srt.speculative")
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True) as (sched, worker):
        policy = worker.adaptive
        assert calibration_batch_sizes(16, 32) == [1, 2, 3, 6, 12]
        assert set(policy.buckets) == {1, 2, 4, 8, 16} and policy.max_tokens_per_step == worker.num_decode_tokens_per_req
        for b in policy.buckets.values():
            assert b.warm() and not (b.draft_warmup or b.plain_warmup) and b.t_draft > 0 and b.t_plain > 0
        assert "5 batch-size buckets calibrated" in caplog.text
        # A second calibration, watched: only slot 0 (the padding) of any pool changes, nothing stays held.
        free_slots, free_rows = worker.token_to_kv_pool_allocator.available_size(), worker.req_to_token_pool.available_size()
        before = _kv_buffers(worker)
        worker.calibrate_adaptive()
        for old, new in zip(before, _kv_buffers(worker)):
            assert torch.equal(old[1:], new[1:])
        assert worker.token_to_kv_pool_allocator.available_size() == free_slots
        assert worker.req_to_token_pool.available_size() == free_rows
        assert worker.deferred_context.size == 0 and worker.last_step is None
        run = generate(sched, prompts, [greedy(30), greedy(30)])
    for i, p in enumerate(prompts):
        assert run.ids[f"r{i}"] == target_greedy(target, p, 30)
    # No bucket measured itself with warm-up steps: every one decided from its calibrated times.
    assert all(not (b.draft_warmup or b.plain_warmup) for b in policy.buckets.values()), policy.buckets
    assert sched.spec_drafted_steps >= 1  # the accept length was sampled (the first drafted step)


def _draft_kv_of(worker, req):
    """The draft pool's K and V of every layer at the request's committed positions (copies)."""
    slots = worker.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
    pool = worker.draft_runner.token_to_kv_pool
    return [t[slots].clone() for i in range(len(worker.draft_model.layers)) for t in pool.get_kv_buffer(i)]


def _kv_at_first_block(worker, when=lambda: True):
    """Spy: the draft K/V of the first request's committed positions when the first drafted block with when() runs."""
    seen = {}
    with_draft = worker._decode_with_draft

    def spy(batch, slots):
        if "kv" not in seen and when():
            seen["kv"] = _draft_kv_of(worker, batch.reqs[0])
        return with_draft(batch, slots)

    worker._decode_with_draft = spy
    return seen


def _pause_and_resume(target_dir, draft_dir, prompt, pattern, max_new):
    """One request through a scripted drafted / draft-free pattern: output ids, tokens per step, the deferred
    rows seen before each step, and the draft K/V of its committed positions when the first resumed block runs."""
    with spec_scheduler(target_dir, draft_dir, speculative_adaptive=True) as (sched, worker):
        worker.adaptive = policy = ScriptedPolicy(pattern)
        pending = []
        snapshot = _kv_at_first_block(worker, when=lambda: policy.asked > pattern.index(False))
        sched.add_request(TokenizedGenerateReqInput(rid="a", input_text=None, input_ids=list(prompt),
                                                    sampling_params=greedy(max_new), stream=True))
        ids, steps = [], []
        while sched.has_work():
            pending.append(worker.deferred_context.size)
            for msg in sched.step():
                ids.extend(msg.output_ids[0])
                steps.append(len(msg.output_ids[0]))
    return ids, steps, pending, snapshot["kv"]


def test_draft_free_steps_defer_the_draft_context_and_a_resumed_block_sees_it_complete(trained, monkeypatch):
    """Draft-free steps only keep their feature rows; the drafted step that follows writes them in one pass
    first. Output, per-step acceptance and the draft K/V the resumed block reads equal a run that writes the
    context K/V every step (a one-row deferred context buffer), and the output is target-only greedy decoding."""
    import sglite.srt.model_executor.pool_configurator as pc

    target_dir, tr, target, draft = trained
    prompt, max_new = tr.prompts[0], 30
    pattern = [True, True] + [False] * 8 + [True] * 40
    ids, steps, pending, kv = _pause_and_resume(target_dir, tr.draft_dir, prompt, pattern, max_new)
    monkeypatch.setattr(pc, "MAX_DEFERRED_CONTEXT_ROWS", 1)
    ids_eager, steps_eager, pending_eager, kv_eager = _pause_and_resume(target_dir, tr.draft_dir, prompt, pattern, max_new)
    assert ids == ids_eager == target_greedy(target, prompt, max_new)
    assert steps == steps_eager and max(steps[1 + 10:]) > 1  # the resumed draft is accepted again
    # Before step k (prefill first, two drafted steps), k - 3 draft-free steps' rows wait, up to all 8 before
    # the resumed step, which writes them first; the eager run keeps none.
    assert pending[3:12] == list(range(9)) and pending[12:] == [0] * len(pending[12:]) and set(pending_eager) == {0}
    assert len(kv) == len(kv_eager) > 0
    for a, b in zip(kv, kv_eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_deferred_context_buffer_is_the_planned_one(trained):
    """Draft-free steps defer into the buffer the plan priced (allocated bytes == planned bytes, as every pool);
    without the flags there is neither buffer nor plan line, and a worker that could skip the draft on such a
    plan is refused."""
    from sglite.srt.mem_cache.pool_plan import MemoryPlanError
    from sglite.srt.speculative.adaptive import AdaptiveSpeculation
    from sglite.srt.speculative.dflash_worker import DFlashWorker

    target_dir, tr, _, _ = trained
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True) as (_, worker):
        buf = worker.deferred_context
        planned = worker.target_runner.memory_pool_config.planned_pool_bytes["draft_deferred_context"]
        hidden = worker.target_model.config.hidden_size
        # 256 rows of the captured layers' fp32 features, plus an int64 position and slot each
        assert buf.nbytes() == planned == 256 * (len(worker.capture_layers) * hidden * 4 + 8 + 8)
        assert buf is worker.draft_runner.kv_pools.deferred_context
        report = worker.rank_report()
        assert report["allocated_pool_bytes"]["draft_deferred_context"] == planned
        assert report["planned_pool_bytes"] == report["allocated_pool_bytes"]
    with spec_scheduler(target_dir, tr.draft_dir) as (_, worker):
        assert worker.deferred_context is None
        assert "draft_deferred_context" not in worker.target_runner.memory_pool_config.planned_pool_bytes
        with pytest.raises(MemoryPlanError, match="no deferred draft context buffer"):
            DFlashWorker(worker.target_runner, worker.draft_runner, adaptive=AdaptiveSpeculation())


@pytest.mark.parametrize("radix", [True, False])
def test_deferred_context_is_written_before_its_slots_are_reused(trained, radix):
    """A request that runs on draft-free steps only defers its feature rows; the scheduler has them written when
    it releases the request. A second request either extends it and shares those cached slots (radix), or
    has another prompt and gets the freed slots back from the allocator (no cache: stale rows written later
    would overwrite its prompt's context K/V). Either way the draft K/V its first block reads equals that of
    the same request on a fresh server, and its per-step acceptance equals the reference loop's."""
    target_dir, tr, target, draft = trained
    base = tr.prompts[7]
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True, disable_radix_cache=not radix) as (sched, worker):
        worker.adaptive = ScriptedPolicy([False])
        flush, flushed = worker.flush_deferred_kv, []

        def spy_flush():
            flushed.append(worker.deferred_context.size)
            flush()

        worker.flush_deferred_kv = spy_flush
        first = generate(sched, [base], [greedy(12)], rid_prefix="a")
        assert max(flushed) == 11 and worker.deferred_context.size == 0  # its 11 draft-free steps, written at its release
        alloc = sched.allocator
        if not radix:  # hand its freed K/V slots (the last free) out first, as the allocator does once it cycles
            freed = alloc._released[::-1] + [alloc._free_pages]
            alloc._free_pages, alloc._released, alloc._num_released = torch.cat(freed), [], 0
        worker.adaptive = ScriptedPolicy([True])
        extended = base + first.ids["a0"][:10] if radix else tr.prompts[2] + tr.prompts[3] + tr.prompts[4]
        # Without the cache its prompt covers every slot the first request held.
        assert radix or len(extended) > len(base) + 12
        seen = _kv_at_first_block(worker)
        second = generate(sched, [extended], [greedy(16)], rid_prefix="b")
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True) as (sched, worker):
        worker.adaptive = ScriptedPolicy([True])
        fresh = _kv_at_first_block(worker)
        alone = generate(sched, [extended], [greedy(16)], rid_prefix="b")
    assert first.ids["a0"] == target_greedy(target, base, 12)
    assert second.cached["b0"] >= len(base) + 8 if radix else second.cached["b0"] == 0
    assert second.ids["b0"] == alone.ids["b0"]
    ref_ids, ref_lens = reference_block_generate(draft, target, extended, 16)
    assert second.ids["b0"] == ref_ids and second.steps["b0"][1:] == ref_lens
    assert len(seen["kv"]) == len(fresh["kv"]) > 0
    for a, b in zip(seen["kv"], fresh["kv"]):  # (radix: the shared rows came from decode forwards, not a prefill)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("off", [True, False])
def test_running_requests_mix_into_a_prefill_only_while_drafting_is_off(trained, off):
    """CPU mixed chunks on a DFLASH worker: while the policy has drafting off, a decoding request takes its
    token inside the next prompt's prefill (as a plain server); while it drafts, it waits for its own drafted
    step. Greedy output is the target's either way."""
    target_dir, tr, target, _ = trained
    prompt_a, prompt_b = tr.prompts[0], tr.prompts[5]
    with spec_scheduler(target_dir, tr.draft_dir, speculative_adaptive=True) as (sched, worker):
        assert sched.enable_mixed_chunk  # the CPU default
        worker.adaptive = ScriptedPolicy([not off], off=off)
        prefill = worker.forward_prefill
        prefill_sizes = []

        def spy(batch):
            prefill_sizes.append(batch.batch_size)
            return prefill(batch)

        worker.forward_prefill = spy
        ids: dict[str, list[int]] = {}
        verify_ct: dict[str, int] = {}
        for n in range(10000):
            if n == 3:
                sched.add_request(TokenizedGenerateReqInput(rid="b", input_text=None, input_ids=list(prompt_b),
                                                            sampling_params=greedy(12), stream=True))
            if n == 0:
                sched.add_request(TokenizedGenerateReqInput(rid="a", input_text=None, input_ids=list(prompt_a),
                                                            sampling_params=greedy(24), stream=True))
            if n > 0 and not sched.has_work():
                break
            for msg in sched.step():
                for j, rid in enumerate(msg.rids):
                    ids.setdefault(rid, []).extend(msg.output_ids[j])
                    verify_ct[rid] = msg.spec_verify_ct[j]
        draft_free_steps = sched.spec_draft_free_steps
    assert ids["a"] == target_greedy(target, prompt_a, 24) and ids["b"] == target_greedy(target, prompt_b, 12)
    assert prefill_sizes == ([1, 2] if off else [1, 1])  # b's prefill carried a's decode token only when off
    if off:  # the mixed-in token counts as a's draft-free step: one step per token after the first
        assert verify_ct == {"a": 23, "b": 11} and draft_free_steps == 23


def test_disable_by_batch_size_needs_a_block_draft():
    from sglite.srt.server_args import ServerArgsError

    with pytest.raises(ServerArgsError, match="--speculative-disable-by-batch-size"):
        ServerArgs(model_path="/some/target", speculative_disable_by_batch_size=4).validate()
    ServerArgs(speculative_disable_by_batch_size=4).validate()  # the embedded default pair has a DFLASH draft


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """A tiny target whose rope covers only 64 positions, and a random (untrained) draft."""
    from sglite.testing.tiny_dflash import TINY_VOCAB, build_tiny_dflash_draft
    from sglite.testing.tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("dflash_short")
    target_dir = build_tiny_model(
        str(d / "target"), "qwen3", seed=0, with_tokenizer=False, num_hidden_layers=4, vocab_size=TINY_VOCAB,
        eos_token_id=None, max_position_embeddings=64,
    )
    return target_dir, build_tiny_dflash_draft(str(d / "draft"), target_dir)


def test_context_len_is_the_plans_and_a_request_may_fill_it(short_context):
    """The block is reserved inside the model's limit: 64 is served as 64 (not 64 + B + 1), filled exactly.

    The last steps' block rows run past position 63, where rope has no angle; the worker keeps them
    inside, and the output is still the target's own greedy continuation.
    """
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = short_context
    prompt = random_prompts(1, seed=3, min_len=8, max_len=8)[0]
    with spec_scheduler(target_dir, draft_dir, context_length=None) as (sched, worker):
        assert worker.context_len == worker.target_runner.memory_pool_config.context_len == sched.context_len == 64
        run = generate(sched, [prompt, prompt], [greedy(64 - len(prompt)), greedy(64 - len(prompt) + 1)])
        assert sched.allocator.available_size() + sched.tree_cache.total_size() == sched.initial_free_slots
    assert run.finish["r1"]["type"] == "abort" and "context length 64" in run.finish["r1"]["message"]
    assert run.finish["r0"]["type"] == "length" and len(run.ids["r0"]) == 64 - len(prompt)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assert run.ids["r0"] == target_greedy(target, prompt, 64 - len(prompt))
    # --context-length 40 is served as 40 (it was 40 + B + 1).
    with spec_scheduler(target_dir, draft_dir, context_length=40) as (sched, worker):
        assert worker.context_len == worker.target_runner.memory_pool_config.context_len == sched.context_len == 40
        run = generate(sched, [prompt], [greedy(40 - len(prompt))])
    assert run.ids["r0"] == target_greedy(target, prompt, 40 - len(prompt))


def test_temperature_1e_39_with_dflash_is_greedy(short_context, caplog):
    """Regression: temperature 1e-39 made the verify probabilities NaN and killed the scheduler.

    Also: the "Decode batch." stats line carries SGLang's accept length when speculating.
    """
    import logging
    import re

    target_dir, draft_dir = short_context
    prompt = random_prompts(1, seed=4)[0]
    with spec_scheduler(target_dir, draft_dir, decode_log_interval=2) as (sched, _):
        with caplog.at_level(logging.INFO, logger="sglite.srt.managers.scheduler"):
            run = generate(sched, [prompt, prompt], [SamplingParams(max_new_tokens=12, temperature=1e-39), greedy(12)])
    assert run.ids["r0"] == run.ids["r1"] and len(run.ids["r0"]) == 12
    decode = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert decode and all(re.search(r", accept len: \d+\.\d\d, gen throughput", m) for m in decode), decode


def shuffled_token_map(tmp_path, vocab_size, keep=None) -> str:
    """A --speculative-token-map file: ``keep`` (default: every id) in a seeded shuffled order."""
    ids = torch.arange(vocab_size) if keep is None else torch.tensor(sorted(keep))
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(5))]
    path = tmp_path / f"token_map_{ids.numel()}.pt"
    torch.save(ids, path)
    return str(path)


@pytest.mark.parametrize("algo", ["DFLASH", "DSPARK"])
def test_token_map_of_the_whole_vocab_drafts_exactly_as_without(trained, tmp_path, algo):
    """A shuffled full-vocabulary map changes only the column order of the draft head: same drafts, same steps."""
    from sglite.testing.tiny_dflash import build_tiny_dspark_draft

    target_dir, tr, target, _ = trained
    draft_dir = tr.draft_dir
    if algo == "DSPARK":  # the Markov bias must be gathered to the map's columns too
        draft_dir = build_tiny_dspark_draft(str(tmp_path / "dspark"), tr.draft_dir, markov_rank=8, markov_scale=1.0)
    prompts = [tr.prompts[4], tr.prompts[5]] + random_prompts(1, seed=13)
    max_new = 19
    runs, drafts = [], []
    token_map = shuffled_token_map(tmp_path, target.config.vocab_size)
    for flags in ({}, {"speculative_token_map": token_map}):
        with spec_scheduler(target_dir, draft_dir, speculative_algorithm=algo, **flags) as (sched, worker):
            if flags:
                assert worker.draft_model.hot_head.num_tokens == target.config.vocab_size
            drafts.append(record_drafts(worker))
            runs.append(generate(sched, prompts, [greedy(max_new)] * len(prompts)))
    full, mapped = runs
    assert drafts[0] and drafts[1] == drafts[0]
    assert mapped.ids == full.ids and mapped.steps == full.steps
    if algo == "DFLASH":  # the tiny draft was trained as DFLASH; the Markov-biased one rarely hits
        assert any(max(steps[1:]) > 1 for steps in mapped.steps.values())


def record_drafts(worker) -> list[list[int]]:
    """Every proposal the worker's draft makes from now on (flattened per step), appended to the returned list."""
    seen: list[list[int]] = []
    propose = worker.draft_model.propose_drafts

    def recording(*a, **kw):
        out = propose(*a, **kw)
        seen.append(out.ids.reshape(-1).tolist())
        return out

    worker.draft_model.propose_drafts = recording
    return seen


def test_partial_token_map_drafts_only_its_tokens_and_stays_lossless(trained, tmp_path):
    """Half the vocabulary: every draft is a mapped id, and greedy output is still the target's own."""
    target_dir, tr, target, draft = trained
    vocab = target.config.vocab_size
    prompts = [tr.prompts[6], tr.prompts[7]] + random_prompts(2, seed=17, min_len=3, max_len=12)
    max_new = 21
    # The reference's own greedy tokens stay in the map, so the draft keeps proposing accepted tokens.
    keep = {t for p in prompts for t in target_greedy(target, p, max_new)}
    keep |= set(torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[: vocab // 2].tolist())
    token_map = shuffled_token_map(tmp_path, vocab, keep)
    with spec_scheduler(target_dir, tr.draft_dir, speculative_token_map=token_map) as (sched, worker):
        assert worker.draft_model.hot_head.num_tokens == len(keep) < vocab
        drafted = record_drafts(worker)
        run = generate(sched, prompts, [greedy(max_new)] * len(prompts))
    assert drafted and {t for step in drafted for t in step} <= keep
    for i, p in enumerate(prompts):
        assert run.ids[f"r{i}"] == target_greedy(target, p, max_new)
    assert any(max(steps[1:]) > 1 for steps in run.steps.values())
