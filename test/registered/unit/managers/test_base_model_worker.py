"""BaseModelWorker: the seam every worker implements; a serving rank's report equals `sglite plan`'s."""

import contextlib

import pytest

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.managers.base_model_worker import BaseModelWorker, format_rank_report
from sglite.srt.managers.tp_worker import TpModelWorker
from sglite.srt.planner import plan_topology
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs
from sglite.srt.speculative.dflash_worker import DFlashWorker, create_dflash_worker
from sglite.testing.fake_model_worker import FakeModelWorker
from sglite.testing.tiny_dflash import build_tiny_dflash_draft, build_tiny_target

SUITE = "unit-cpu"
EST_TIME = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    target = build_tiny_target(str(d / "target"))
    return target, build_tiny_dflash_draft(str(d / "draft"), target)


def _args(target, draft=None, **kw):
    spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=draft) if draft else {}
    return ServerArgs(model_path=target, device="cpu", cpu_kv_cache_budget_mb=2, **spec, **kw).validate()


@contextlib.contextmanager
def _worker(args, speculative):
    """A worker on a one-rank runtime, torn down afterwards."""
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            yield create_dflash_worker(args) if speculative else TpModelWorker.create(args)
        finally:
            destroy_parallel_runtime()


@pytest.mark.parametrize("speculative", [False, True])
def test_rank_report_equals_the_planners(pair, speculative):
    target, draft = pair
    args = _args(target, draft if speculative else None)
    with _worker(args, speculative) as worker:
        served = worker.rank_report()
    planned = plan_topology(args)[0].rank_report
    assert served == planned
    assert format_rank_report(served) == format_rank_report(planned)
    assert served["allocated_pool_bytes"] == served["planned_pool_bytes"]
    assert (served["allocated_draft_kv_bytes"] > 0) == speculative


def _check_seam(w):
    """Capacities come from the target runner's plan, for every worker."""
    plan = w.target_runner.memory_pool_config
    assert isinstance(w, BaseModelWorker) and w.builds_pools
    assert (w.max_total_num_tokens, w.max_running_requests) == (plan.max_total_num_tokens, plan.max_running_requests)
    assert w.dp_peer_group is None and w.memory_plan()["max_total_num_tokens"] == plan.max_total_num_tokens


def test_workers_share_one_interface(pair):
    target, draft = pair
    with _worker(_args(target), False) as tp:
        _check_seam(tp)
        assert tp.draft_runner is None and tp.context_len == tp.target_runner.memory_pool_config.context_len
    with _worker(_args(target, draft), True) as spec:
        _check_seam(spec)
        assert isinstance(spec, DFlashWorker) and spec.draft_runner is not None
    fake = FakeModelWorker()
    assert not fake.builds_pools and fake.dp_peer_group is None and not fake.supports_logprobs
