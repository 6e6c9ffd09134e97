"""cpu_threads: the scheduler's thread plan from --cpu-threads, SGLANG_CPU_OMP_THREADS_BIND and the CPUs, and
the CPUs the front end is pinned to."""

import os

import pytest

from sglite.srt.managers.cpu_threads import (
    CpuThreadPlan,
    frontend_cpus,
    parse_cpu_list,
    plan_cpu_threads,
    scheduler_rank_index,
)
from sglite.srt.server_args import ServerArgs, ServerArgsError

SUITE = "unit-cpu"
EST_TIME = 1


def cpus(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def test_default_reserves_one_cpu_for_the_front_end_and_pins_each_rank():
    assert plan_cpu_threads(None, 0, 1, None, cpus(2)) == CpuThreadPlan(1, (0,))
    assert plan_cpu_threads(None, 0, 1, None, cpus(1)) == CpuThreadPlan(1)  # no CPU over: not pinned
    assert plan_cpu_threads(None, 1, 2, None, cpus(17)) == CpuThreadPlan(8, tuple(range(8, 16)))
    # SGLang's default value of the variable means the same as leaving it unset.
    assert plan_cpu_threads(None, 0, 1, "all", (4, 2)) == CpuThreadPlan(1, (2,))


def test_a_user_set_omp_num_threads_is_kept_without_the_flag():
    assert plan_cpu_threads(None, 0, 1, None, cpus(64), omp_num_threads="1") == CpuThreadPlan(1, (0,))
    assert plan_cpu_threads(4, 0, 1, None, cpus(64), omp_num_threads="1") == CpuThreadPlan(4, (0, 1, 2, 3))
    assert plan_cpu_threads(None, 0, 1, None, cpus(3), omp_num_threads="") == CpuThreadPlan(2, (0, 1))


def test_ranks_that_would_take_every_cpu_are_not_pinned():
    assert plan_cpu_threads(2, 0, 1, None, cpus(2)) == CpuThreadPlan(2)
    assert plan_cpu_threads(3, 0, 1, None, cpus(2)) == CpuThreadPlan(3)
    assert plan_cpu_threads(1, 1, 2, None, cpus(2)) == CpuThreadPlan(1)
    assert frontend_cpus(2, 1, None, cpus(2)) is None


def test_the_front_end_gets_the_cpus_the_ranks_leave():
    assert frontend_cpus(None, 1, None, cpus(2)) == (1,)
    assert frontend_cpus(None, 2, None, cpus(17)) == (16,)
    assert frontend_cpus(1, 2, None, (3, 5, 9, 11)) == (9, 11)
    assert frontend_cpus(None, 1, "0|", cpus(4)) is None  # the user placed the ranks


def test_flag_wins_and_env_binds_each_rank_to_its_cpus():
    assert plan_cpu_threads(None, 1, 2, "0-3|4-5,7", cpus(8)) == CpuThreadPlan(3, (4, 5, 7))
    assert plan_cpu_threads(2, 0, 2, "0-3|4-7", cpus(8)) == CpuThreadPlan(2, (0, 1, 2, 3))
    # DP replicas: the lists are per TP rank, so rank 1 of replica 1 (index 3) reads the second list.
    assert plan_cpu_threads(None, 3, 4, "0|1", cpus(8), tp_rank=1, tp_size=2) == CpuThreadPlan(1, (1,))


def test_rank_indices_follow_the_launchers_global_ranks():
    assert ServerArgs(tp_size=2, dp_size=3, enable_dp_attention=False).num_scheduler_ranks == 6
    assert ServerArgs(tp_size=4, dp_size=2, enable_dp_attention=True).num_scheduler_ranks == 4
    assert [scheduler_rank_index(r, 2, d, False) for d in range(3) for r in range(2)] == list(range(6))
    assert scheduler_rank_index(3, 4, 1, True) == 3


@pytest.mark.parametrize("bind, tp, match", [("0-3", 2, "one per rank"), ("3-1", 1, "CPU list"), ("a", 1, "CPU list")])
def test_malformed_bind_is_a_clear_error(bind, tp, match):
    with pytest.raises(ValueError, match=match):
        plan_cpu_threads(None, 0, tp, bind, cpus(8))


def test_cpu_list_and_flag_validation():
    assert parse_cpu_list("0-2, 5") == (0, 1, 2, 5)
    with pytest.raises(ServerArgsError, match="--cpu-threads"):
        ServerArgs(cpu_threads=0).validate()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to leave one to the front end")
def test_a_pinned_process_runs_only_on_its_cpus():
    """The pinning calls themselves, in a child process (so this test process keeps its CPUs)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        scheduler_cpus, frontend = pool.apply(_pin_in_child)
    available = sorted(os.sched_getaffinity(0))
    assert scheduler_cpus == (available[0],)
    assert frontend == tuple(available[1:])


def _pin_in_child() -> tuple[tuple[int, ...], tuple[int, ...]]:
    from sglite.srt.managers.cpu_threads import apply_scheduler_threads, pin_to_frontend_cpus

    args = ServerArgs(cpu_threads=None)
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    os.environ.pop("OMP_NUM_THREADS", None)
    spawned_with = os.sched_getaffinity(0)
    frontend = pin_to_frontend_cpus(args)
    assert tuple(sorted(os.sched_getaffinity(0))) == frontend
    os.sched_setaffinity(0, spawned_with)  # back to the spawned set, as a freshly spawned scheduler has it
    plan = apply_scheduler_threads(args, 0, 1)
    assert tuple(sorted(os.sched_getaffinity(0))) == plan.cpus
    return plan.cpus, frontend
