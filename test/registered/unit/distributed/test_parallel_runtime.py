"""Parallel runtime on real multi-process gloo groups: widths, ranks, and which ranks a collective reaches."""

import time

import pytest
import torch

from sglite.srt.distributed import parallel_state as ps
from sglite.srt.distributed.bootstrap import destroy_parallel_runtime, init_parallel_runtime, simulate_rank
from sglite.srt.distributed.local_launch import run_local_ranks
from sglite.srt.distributed.parallel_state import (
    GroupCoordinator,
    get_attn_cp_group,
    get_attn_dp_peer_group,
    get_attn_tp_group,
    get_tp_group,
)
from sglite.srt.runtime_context import ParallelNotInitializedError, ParallelState, get_parallel, publish, scoped
from sglite.srt.server_args import ServerArgs

SUITE = "unit-cpu"
EST_TIME = 12


def _widths_and_sums(rank, world_size, init_method, dp_size, enable_dp_attention, attn_cp_size):
    """Runs on one rank: init, then report the stamped fields and what each group's collectives saw."""
    state = ParallelState(
        tp_size=world_size, dp_size=dp_size, enable_dp_attention=enable_dp_attention, attn_cp_size=attn_cp_size
    )
    publish(parallel=state)
    init_parallel_runtime(state, rank, world_size, init_method, "gloo", timeout_s=60)
    p = get_parallel()
    # 10**rank makes every member set's sum distinct, so a sum shows exactly who took part.
    contrib = 10.0**rank
    attn_tp_sum = get_attn_tp_group().all_reduce(torch.tensor([contrib], dtype=torch.float64)).item()
    tp_sum = get_tp_group().all_reduce(torch.tensor([contrib], dtype=torch.float64)).item()
    cp_sum = get_attn_cp_group().all_reduce(torch.tensor([contrib], dtype=torch.float64)).item()
    dp_peer_sum = get_attn_dp_peer_group().all_reduce(torch.tensor([contrib], dtype=torch.float64)).item()
    gathered = get_attn_tp_group().all_gather(torch.tensor([[rank, rank]]), dim=1).tolist()
    out = {
        "attn_tp_size": p.attn_tp_size,
        "attn_dp_size": p.attn_dp_size,
        "tp_rank": p.tp_rank,
        "attn_tp_rank": p.attn_tp_rank,
        "attn_dp_rank": p.attn_dp_rank,
        "attn_cp_rank": p.attn_cp_rank,
        "dp_rank": p.dp_rank,
        "world_size": p.world_size,
        "backend": p.backend,
        "attn_tp_ranks": get_attn_tp_group().ranks,
        "attn_tp_sum": attn_tp_sum,
        "tp_sum": tp_sum,
        "cp_sum": cp_sum,
        "dp_peer_sum": dp_peer_sum,
        "gathered": gathered,
    }
    destroy_parallel_runtime()
    return out


def _sum_of(members):
    return float(sum(10**r for r in members))


@pytest.mark.timeout(120)
def test_world4_tp4():
    res = run_local_ranks(_widths_and_sums, 4, 1, False, 1)
    for rank, r in enumerate(res):
        assert (r["attn_tp_size"], r["attn_dp_size"]) == (4, 1)
        assert (r["tp_rank"], r["attn_tp_rank"], r["attn_dp_rank"], r["dp_rank"]) == (rank, rank, 0, 0)
        assert r["world_size"] == 4 and r["backend"] == "gloo"
        assert r["attn_tp_sum"] == r["tp_sum"] == _sum_of([0, 1, 2, 3])
        assert r["cp_sum"] == 10.0**rank  # attention-CP group of one: the identity
        assert r["dp_peer_sum"] == 10.0**rank  # no DP attention: no peers
        assert r["gathered"] == [[0, 0, 1, 1, 2, 2, 3, 3]]


@pytest.mark.timeout(120)
def test_tp4_dp2_dp_attention():
    res = run_local_ranks(_widths_and_sums, 4, 2, True, 1)
    groups = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank, r in enumerate(res):
        assert (r["attn_tp_size"], r["attn_dp_size"]) == (2, 2)
        assert r["attn_tp_ranks"] == groups[rank]
        assert r["attn_tp_rank"] == rank % 2
        assert r["attn_dp_rank"] == r["dp_rank"] == rank // 2
        # Only the attention-TP members are summed; the TP group still spans all four.
        assert r["attn_tp_sum"] == _sum_of(groups[rank])
        assert r["tp_sum"] == _sum_of([0, 1, 2, 3])
        assert r["gathered"] == [[m for m in groups[rank] for _ in range(2)]]
        # Peers: the same attention-TP index in the other group (0<->2, 1<->3).
        assert r["dp_peer_sum"] == _sum_of([rank % 2, rank % 2 + 2])


@pytest.mark.timeout(120)
def test_tp4_dp4_dp_attention():
    res = run_local_ranks(_widths_and_sums, 4, 4, True, 1)
    for rank, r in enumerate(res):
        assert (r["attn_tp_size"], r["attn_dp_size"]) == (1, 4)
        assert r["attn_tp_ranks"] == [rank]
        assert (r["attn_tp_rank"], r["attn_dp_rank"], r["dp_rank"]) == (0, rank, rank)
        assert r["attn_tp_sum"] == 10.0**rank
        assert r["tp_sum"] == _sum_of([0, 1, 2, 3])
        assert r["dp_peer_sum"] == _sum_of([0, 1, 2, 3])  # attn_tp 1: every rank is every other's peer


@pytest.mark.timeout(120)
def test_tp4_cp2_layout():
    # (dp, cp, tp) with tp fastest: attn-TP groups [0,1],[2,3]; attn-CP groups [0,2],[1,3].
    res = run_local_ranks(_widths_and_sums, 4, 1, False, 2)
    cp_groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    tp_groups = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank, r in enumerate(res):
        assert (r["attn_tp_size"], r["attn_dp_size"]) == (2, 1)
        assert (r["attn_tp_rank"], r["attn_cp_rank"]) == (rank % 2, rank // 2)
        assert r["attn_tp_sum"] == _sum_of(tp_groups[rank])
        assert r["cp_sum"] == _sum_of(cp_groups[rank])


def _read_before_and_after(rank, world_size, init_method):
    publish(parallel=ParallelState(tp_size=world_size))
    with pytest.raises(ParallelNotInitializedError) as before:
        get_parallel().attn_tp_size
    with pytest.raises(ParallelNotInitializedError):
        get_tp_group()
    init_parallel_runtime(get_parallel(), rank, world_size, init_method, "gloo", timeout_s=60)
    after = get_parallel().attn_tp_size
    destroy_parallel_runtime()
    return str(before.value), after, get_parallel().tp_size


@pytest.mark.timeout(60)
def test_attn_tp_size_before_and_after_init():
    for message, after, tp_size in run_local_ranks(_read_before_and_after, 2):
        assert "attn_tp_size" in message and "initialize_model_parallel" in message
        assert after == 2 and tp_size == 2


def _broadcasts(rank, world_size, init_method):
    init_parallel_runtime(ParallelState(tp_size=world_size), rank, world_size, init_method, "gloo", timeout_s=60)
    group = get_tp_group()
    t = torch.full((3,), float(rank))
    group.broadcast(t, src=1)
    obj = group.broadcast_object({"from": rank, "list": [rank] * 2} if rank == 1 else None, src=1)
    everyone = group.all_gather_object(("r", rank))
    group.barrier()
    destroy_parallel_runtime()
    return t.tolist(), obj, everyone


@pytest.mark.timeout(60)
def test_broadcast_and_objects():
    for t, obj, everyone in run_local_ranks(_broadcasts, 2):
        assert t == [1.0, 1.0, 1.0]
        assert obj == {"from": 1, "list": [1, 1]}
        assert everyone == [("r", 0), ("r", 1)]


def _init_from_server_args(rank, world_size, init_method):
    host_port = init_method.removeprefix("tcp://")
    args = ServerArgs(tp_size=2, dist_init_addr=host_port, dist_timeout=30, device="cpu")
    state = init_parallel_runtime(args, rank)
    out = (state is get_parallel(), state.backend, state.world_size, state.attn_tp_size)
    destroy_parallel_runtime()
    return out


@pytest.mark.timeout(60)
def test_init_from_server_args_uses_dist_init_addr_and_gloo_on_cpu():
    assert run_local_ranks(_init_from_server_args, 2) == [(True, "gloo", 2, 2)] * 2


def _mismatched_groups(rank, world_size, init_method):
    # A group builder that disagrees with derive_attention_widths must stop start-up.
    ps.attn_tp_group_ranks = lambda attn_tp, attn_cp, attn_dp: [[r] for r in range(attn_tp * attn_cp * attn_dp)]
    with pytest.raises(RuntimeError, match="derive_attention_widths") as err:
        init_parallel_runtime(ParallelState(tp_size=world_size), rank, world_size, init_method, "gloo", timeout_s=60)
    return str(err.value)


@pytest.mark.timeout(60)
def test_built_widths_must_match_derived():
    for msg in run_local_ranks(_mismatched_groups, 2):
        assert "memory plan" in msg


def _lonely_rank(rank, world_size, init_method):
    if rank == 1:
        return None  # never joins: rank 0's rendezvous must give up quickly
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:  # torch.distributed.DistStoreError is a RuntimeError
        init_parallel_runtime(ParallelState(tp_size=2), 0, 2, init_method, "gloo", timeout_s=3)
    return time.monotonic() - t0, type(err.value).__name__


@pytest.mark.timeout(60)
def test_broken_rendezvous_fails_fast():
    elapsed, err_type = run_local_ranks(_lonely_rank, 2)[0]
    assert elapsed < 30, f"init hung for {elapsed:.1f} s ({err_type}) despite a 3 s timeout"


# ------------------------------------------------------------------ single process


def test_one_rank_world_needs_no_process_group():
    state = ParallelState(tp_size=1)
    with scoped(parallel=state):
        init_parallel_runtime(state, 0, 1, None, "gloo")
        try:
            assert not torch.distributed.is_initialized()
            assert (state.attn_tp_size, state.attn_dp_size, state.tp_rank) == (1, 1, 0)
            x = torch.arange(4.0)
            assert get_tp_group().all_reduce(x) is x and x.tolist() == [0, 1, 2, 3]
            assert get_attn_tp_group().all_gather(x, dim=0).tolist() == [0, 1, 2, 3]
            assert get_tp_group().broadcast_object("obj") == "obj"
            with pytest.raises(RuntimeError, match="already initialised"):
                init_parallel_runtime(state, 0, 1, None, "gloo")
        finally:
            destroy_parallel_runtime()
    with pytest.raises(ParallelNotInitializedError, match="initialize_model_parallel"):
        get_tp_group()


def test_world_larger_than_tp_is_rejected():
    state = ParallelState(tp_size=1)
    with scoped(parallel=state):
        with pytest.raises(ValueError, match="rendezvous"):
            init_parallel_runtime(state, 0, 2, None, "gloo")
        destroy_parallel_runtime()


def test_size_one_group_coordinator_is_identity_without_torch_distributed():
    g = GroupCoordinator([5], 5, "solo")
    t = torch.randn(2, 3)
    assert g.all_reduce(t) is t and g.broadcast(t) is t and g.all_gather(t, dim=0) is t
    assert (g.world_size, g.rank_in_group) == (1, 0)
    with pytest.raises(ValueError, match="outside group"):
        g.broadcast_object(1, src=1)
    with pytest.raises(ValueError, match="no process group"):
        GroupCoordinator([0, 1], 0, "broken")


@pytest.mark.parametrize(
    "tp,dp,dp_attn,cp,expected",
    [
        (16, 16, True, 1, (1, 16)),
        (16, 16, False, 1, (16, 1)),
        (16, 8, True, 2, (1, 8)),
        (8, 2, True, 1, (4, 2)),
    ],
)
def test_simulate_rank_every_rank(tp, dp, dp_attn, cp, expected):
    seen = set()
    for rank in range(tp):
        state = simulate_rank(ParallelState(tp_size=tp, dp_size=dp, enable_dp_attention=dp_attn, attn_cp_size=cp), rank)
        assert (state.attn_tp_size, state.attn_dp_size) == expected
        attn_tp = expected[0]
        # The documented layout formula, written out independently of rank_layout().
        assert rank == (state.attn_dp_rank * cp + state.attn_cp_rank) * attn_tp + state.attn_tp_rank
        assert state.dp_rank == (state.attn_dp_rank if dp_attn else 0)
        seen.add((state.attn_dp_rank, state.attn_cp_rank, state.attn_tp_rank))
        with pytest.raises(ParallelNotInitializedError):
            state.tp_group
    assert len(seen) == tp  # every rank has its own coordinates


def test_simulate_rank_rejects_pp():
    with pytest.raises(ValueError, match="pp-size"):
        simulate_rank(ParallelState(tp_size=2, pp_size=2), 0)
