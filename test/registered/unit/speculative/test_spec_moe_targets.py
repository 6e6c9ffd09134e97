"""DFLASH and DSPARK drafts on MoE targets (Qwen3-MoE; DeepSeek-V3 with MLA): lossless, accepting, and
priced exactly next to the target's pool.

The draft reads the target's hidden states at ``target_layer_ids`` and keeps its own dense KV pool; a
rejected block's slots are freed in both pools. Greedy speculative output must equal plain decoding
token for token, and the bytes each pool allocated must equal the plan's.
"""

import contextlib

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.managers.scheduler import Scheduler
from sglite.srt.managers.tp_worker import TpModelWorker
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs
from sglite.srt.speculative.dflash_worker import create_dflash_worker
from sglite.testing.runner_generate import scheduler_greedy_generate
from sglite.testing.tiny_dflash import build_tiny_dspark_draft, build_tiny_target, random_prompts, train_tiny_draft

SUITE = "unit-cpu"
EST_TIME = 60

NEW_TOKENS = 24


def _args(target_dir, **kw):
    base = dict(model_path=target_dir, dtype="float32", device="cpu", cpu_kv_cache_budget_mb=4, context_length=256,
                max_running_requests=16)
    base.update(kw)
    return ServerArgs(**base).validate()


@contextlib.contextmanager
def _scheduler(args, speculative: bool):
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            worker = create_dflash_worker(args) if speculative else TpModelWorker.create(args)
            yield Scheduler(args, worker), worker
        finally:
            destroy_parallel_runtime()


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def pair(request, tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp(request.param)
    target_dir = build_tiny_target(str(d / "target"), seed=5, arch=request.param)
    trained = train_tiny_draft(str(d / "dflash"), target_dir, steps=200, seed=3)
    prompts = trained.prompts[:6] + random_prompts(2, seed=77)  # seen and unseen continuations
    with _scheduler(_args(target_dir), speculative=False) as (sched, _):
        plain = scheduler_greedy_generate(sched, prompts, NEW_TOKENS)
    return request.param, target_dir, trained.draft_dir, prompts, plain


def _run_spec(target_dir, draft_dir, algorithm, prompts):
    args = _args(target_dir, speculative_algorithm=algorithm, speculative_draft_model_path=draft_dir)
    with _scheduler(args, speculative=True) as (sched, worker):
        out = scheduler_greedy_generate(sched, prompts, NEW_TOKENS)
        target, draft = worker.target_runner, worker.draft_runner
        allocated = {**target.kv_pools.allocated_bytes(), **draft.kv_pools.allocated_bytes()}
        planned = {p.name: p.planned_bytes for p in target.memory_pool_config.planned_pools()}
        pool_kinds = (type(target.token_to_kv_pool).__name__, type(draft.token_to_kv_pool).__name__)
        held_slots = sched._kv_tokens_used()  # radix-cached (evictable) slots count as free
        accept_length = sched.spec_accepted_total / max(1, sched.spec_verify_total)
    return out, allocated, planned, pool_kinds, held_slots, accept_length


def test_dflash_draft_is_lossless_and_priced_exactly(pair):
    arch, target_dir, draft_dir, prompts, plain = pair
    out, allocated, planned, kinds, held_slots, accept_length = _run_spec(target_dir, draft_dir, "DFLASH", prompts)
    assert out == plain
    assert allocated == {k: v for k, v in planned.items() if k in allocated} and "draft_kv" in allocated
    assert kinds == ("MLATokenToKVPool" if arch == "deepseek_v3" else "MHATokenToKVPool", "MHATokenToKVPool")
    assert held_slots == 0  # every slot of every accepted and rejected block came back
    assert accept_length > 1.3, accept_length  # the trained draft is accepted, so verify really commits blocks


def test_dspark_draft_is_lossless(pair, tmp_path):
    arch, target_dir, draft_dir, prompts, plain = pair
    dspark_dir = build_tiny_dspark_draft(str(tmp_path / "dspark"), draft_dir, markov_rank=8, markov_scale=0.3)
    out, allocated, planned, _, held_slots, _ = _run_spec(target_dir, dspark_dir, "DSPARK", prompts)
    assert out == plain
    assert allocated == {k: v for k, v in planned.items() if k in allocated}
    assert held_slots == 0
