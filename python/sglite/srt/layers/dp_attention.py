"""DP attention's token exchange: attention per attention-DP group, the MLP and LM head over all of TP.

With ``--enable-dp-attention`` each attention-DP group runs its own batch through attention layers
sharded over its ``attn_tp`` ranks, while the MLP and the LM head are sharded over the whole TP
group. Before those, every rank gathers all groups' tokens from its attention-DP peers (the ranks
with the same attention-TP index in the other groups); afterwards it keeps its own group's rows.

An all-gather needs equal shapes, so each group's rows are padded to the largest group's count.

Invariant: every group reaches each exchange the same number of times, in the same order. A group
with nothing to run still runs an IDLE forward (zero rows); the scheduler keeps groups in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglite.srt.distributed.parallel_state import GroupCoordinator


@dataclass(frozen=True)
class DpTokenLayout:
    """Row counts of every attention-DP group in one exchange, and which group is this rank's."""

    counts: tuple[int, ...]
    own_group: int

    @property
    def padded_rows(self) -> int:
        """Rows each group occupies in the gathered tensor."""
        return max(self.counts)

    @property
    def own_rows(self) -> int:
        """Rows this rank's group contributed."""
        return self.counts[self.own_group]

    def gather(self, local: torch.Tensor, peers: GroupCoordinator) -> torch.Tensor:
        """Every group's rows, group by group, each padded to ``padded_rows``: ``[attn_dp * padded, ...]``."""
        if local.shape[0] != self.own_rows:
            raise ValueError(f"dp gather: layout says this group has {self.own_rows} rows, got {local.shape[0]}")
        padded = local.new_zeros((self.padded_rows, *local.shape[1:]))
        padded[: self.own_rows] = local
        return peers.all_gather(padded, dim=0)

    def scatter(self, gathered: torch.Tensor) -> torch.Tensor:
        """This group's rows of a gathered (then transformed) tensor."""
        start = self.own_group * self.padded_rows
        return gathered[start : start + self.own_rows]


def exchange_layout(num_local_rows: int, peers: GroupCoordinator, device: torch.device) -> DpTokenLayout:
    """Share row counts with the attention-DP peers (one small all-gather) and return the layout."""
    counts = peers.all_gather(torch.tensor([num_local_rows], dtype=torch.int64, device=device), dim=0)
    return DpTokenLayout(counts=tuple(int(c) for c in counts.tolist()), own_group=peers.rank_in_group)


def exchanges_tokens(peers: Optional[GroupCoordinator]) -> bool:
    """Whether a model sharded this way must gather tokens across attention-DP groups."""
    return peers is not None and peers.world_size > 1


def run_over_all_groups(fn, local: torch.Tensor, peers: Optional[GroupCoordinator],
                        layout: Optional[DpTokenLayout] = None) -> torch.Tensor:
    """``fn`` (sharded over the whole TP group) applied to every group's rows; returns this group's rows.

    ``layout`` may be shared by calls with the same row count (the MLPs of one forward); without it
    the counts are exchanged first.
    """
    if not exchanges_tokens(peers):
        return fn(local)
    if layout is None:
        layout = exchange_layout(local.shape[0], peers, local.device)
    return layout.scatter(fn(layout.gather(local, peers)))
