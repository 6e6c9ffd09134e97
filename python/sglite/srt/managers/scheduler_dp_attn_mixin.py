"""DP attention in the scheduler: every attention-DP group steps whenever any group has work.

The groups' MLPs and LM head exchange tokens, so every group runs a forward (an IDLE one if it has
nothing) whenever any group does (layers/dp_attention.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.srt.managers.scheduler import Scheduler

# Every group's loop meets the others once per iteration, so an idle group that waited the scheduler's
# IDLE_POLL_MS for input would stall a busy group's next step by as much; idle groups poll briefly.
DP_ATTENTION_IDLE_POLL_MS = 5


class SchedulerDPAttentionMixin:
    """The per-iteration all-gather of "has work" and the IDLE forward (mixed into Scheduler)."""

    def init_dp_attention(self: "Scheduler") -> None:
        """Find the attention-DP peers (None without DP attention)."""
        self.dp_peer_group = self.worker.dp_peer_group
        self._any_group_busy = False

    def sync_dp_groups(self: "Scheduler") -> bool:
        """DP attention: whether any attention-DP group has work this iteration (one small all-gather)."""
        if self.dp_peer_group is None:
            return self.has_work()
        # A PD group waiting for KV has work too: the others keep stepping (IDLE forwards) until it arrives.
        self._any_group_busy = any(self.dp_peer_group.all_gather_object(self.has_work()))
        return self._any_group_busy

    def run_idle_if_needed(self: "Scheduler", forwarded: bool) -> None:
        """Under DP attention a step always runs one worker forward: IDLE when this group had nothing."""
        if not forwarded and self.dp_peer_group is not None:
            self.worker.forward_idle()
            self.num_idle_forwards += 1

    def idle_poll_ms(self: "Scheduler", default_ms: int) -> int:
        """How long to wait for input when idle: briefly under DP attention (peers meet every iteration)."""
        return default_ms if self.dp_peer_group is None else DP_ATTENTION_IDLE_POLL_MS
