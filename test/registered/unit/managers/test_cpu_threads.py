"""cpu_threads: the scheduler's thread plan from --cpu-threads, SGLANG_CPU_OMP_THREADS_BIND and the CPU count."""

import pytest

from sglite.srt.managers.cpu_threads import CpuThreadPlan, parse_cpu_list, plan_cpu_threads
from sglite.srt.server_args import ServerArgs, ServerArgsError

SUITE = "unit-cpu"
EST_TIME = 1


def test_default_reserves_one_cpu_for_the_front_end_and_splits_over_ranks():
    assert plan_cpu_threads(None, 0, 1, None, available_cpus=2) == CpuThreadPlan(1)
    assert plan_cpu_threads(None, 0, 1, None, available_cpus=1) == CpuThreadPlan(1)
    assert plan_cpu_threads(None, 1, 2, None, available_cpus=17) == CpuThreadPlan(8)


def test_a_user_set_omp_num_threads_is_kept_without_the_flag():
    assert plan_cpu_threads(None, 0, 1, None, available_cpus=64, omp_num_threads="1") == CpuThreadPlan(1)
    assert plan_cpu_threads(4, 0, 1, None, available_cpus=64, omp_num_threads="1") == CpuThreadPlan(4)
    assert plan_cpu_threads(None, 0, 1, None, available_cpus=3, omp_num_threads="") == CpuThreadPlan(2)


def test_flag_wins_and_env_binds_each_rank_to_its_cpus():
    assert plan_cpu_threads(3, 0, 1, None, available_cpus=2) == CpuThreadPlan(3)
    assert plan_cpu_threads(None, 1, 2, "0-3|4-5,7", available_cpus=8) == CpuThreadPlan(3, (4, 5, 7))
    assert plan_cpu_threads(2, 0, 2, "0-3|4-7", available_cpus=8) == CpuThreadPlan(2, (0, 1, 2, 3))


@pytest.mark.parametrize("bind, tp, match", [("0-3", 2, "one per rank"), ("3-1", 1, "CPU list"), ("a", 1, "CPU list")])
def test_malformed_bind_is_a_clear_error(bind, tp, match):
    with pytest.raises(ValueError, match=match):
        plan_cpu_threads(None, 0, tp, bind, available_cpus=8)


def test_cpu_list_and_flag_validation():
    assert parse_cpu_list("0-2, 5") == (0, 1, 2, 5)
    with pytest.raises(ServerArgsError, match="--cpu-threads"):
        ServerArgs(cpu_threads=0).validate()
