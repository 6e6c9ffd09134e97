"""DP attention's token exchange on two gloo ranks: padded all-gather, own-rows scatter, zero-row (IDLE) groups."""

import pytest
import torch

from sglite.srt.distributed.local_launch import run_local_ranks
from sglite.srt.layers.dp_attention import DpTokenLayout, exchange_layout, exchanges_tokens, run_over_all_groups

SUITE = "unit-cpu"
EST_TIME = 6


def test_layout_gather_and_scatter_offsets_without_collectives():
    class OneRankPeers:  # a size-1 "group" whose all-gather is the identity
        world_size, rank_in_group = 1, 0

        @staticmethod
        def all_gather(t, dim=-1):
            return t

    layout = DpTokenLayout(counts=(3,), own_group=0)
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(layout.scatter(layout.gather(x, OneRankPeers)), x)
    two = DpTokenLayout(counts=(1, 4), own_group=0)
    assert (two.padded_rows, two.own_rows) == (4, 1)
    assert torch.equal(two.scatter(torch.arange(8.0)), torch.tensor([0.0]))
    assert torch.equal(DpTokenLayout(counts=(1, 4), own_group=1).scatter(torch.arange(8.0)), torch.arange(4.0, 8.0))
    with pytest.raises(ValueError, match="layout says this group has 1 rows"):
        two.gather(x, OneRankPeers)
    assert not exchanges_tokens(None) and not exchanges_tokens(OneRankPeers)


def _exchange_rank(rank: int, world_size: int, init_method: str, counts: list[int]) -> dict:
    from sglite.srt.distributed.bootstrap import destroy_parallel_runtime, init_parallel_runtime
    from sglite.srt.distributed.parallel_state import get_attn_dp_peer_group
    from sglite.srt.runtime_context import ParallelState, publish

    torch.set_num_threads(1)
    state = ParallelState(tp_size=2, dp_size=2, enable_dp_attention=True)
    publish(parallel=state)
    init_parallel_runtime(state, rank, world_size, init_method, "gloo")
    peers = get_attn_dp_peer_group()
    # Rank r's rows are 100*r + row index, two features each, so every gathered row names its origin.
    local = torch.tensor([[100.0 * rank + i] * 2 for i in range(counts[rank])]).view(-1, 2)
    layout = exchange_layout(local.shape[0], peers, local.device)
    seen = {}

    def fn(rows):
        seen["gathered"] = rows[:, 0].tolist()
        return rows * 2

    out = run_over_all_groups(fn, local, peers, layout)
    again = run_over_all_groups(lambda rows: rows + 1, local, peers)  # counts exchanged inside
    destroy_parallel_runtime()
    return {"counts": layout.counts, "gathered": seen["gathered"], "out": out[:, 0].tolist(), "again": again[:, 0].tolist()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("counts", [[2, 3], [0, 2], [1, 0]])
def test_two_groups_exchange_padded_rows_and_keep_their_own(counts):
    res = run_local_ranks(_exchange_rank, 2, counts, timeout_s=90)
    pad = max(counts)
    for rank, r in enumerate(res):
        assert list(r["counts"]) == counts
        expected = []
        for g, n in enumerate(counts):
            expected += [100.0 * g + i for i in range(n)] + [0.0] * (pad - n)  # zero padding after each group
        assert r["gathered"] == expected
        own = [100.0 * rank + i for i in range(counts[rank])]
        assert r["out"] == [2 * v for v in own]
        assert r["again"] == [v + 1 for v in own]
