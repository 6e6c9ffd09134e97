"""The scheduler's PD component for --disaggregation-mode, built outside the classes it builds."""

from __future__ import annotations

from typing import Any

from sglite.srt.disaggregation.base import PDRank, SchedulerDisagg


def create_disagg(scheduler: Any, worker: Any, server_args: Any, tp_rank: int, world_size: int) -> SchedulerDisagg:
    """PrefillHandoff (prefill), DecodePrealloc (decode), or the no-op component (null).

    A rank's PD identity is its place in its DP group (an attention-DP group, or a replica): the ranks of
    one group share a schedule, so they agree on each room's state among themselves; different groups
    run different requests and never pair.
    """
    mode = server_args.disaggregation_mode
    if mode in (None, "null"):
        return SchedulerDisagg()
    from sglite.srt.distributed.parallel_state import get_attn_tp_group
    from sglite.srt.runtime_context import get_parallel

    par = get_parallel()
    rank = PDRank(
        dp_rank=int(par.dp_rank),
        rank_in_group=int(par.attn_tp_rank),
        group_width=int(par.attn_tp_size),
        num_groups=int(server_args.dp_size),
    )
    group = get_attn_tp_group() if world_size > 1 and par.attn_tp_size > 1 else None
    if mode == "prefill":
        from sglite.srt.disaggregation.prefill import PrefillHandoff

        return PrefillHandoff.create(scheduler, worker, server_args, rank, group)
    if mode == "decode":
        from sglite.srt.disaggregation.decode import DecodePrealloc

        return DecodePrealloc.create(scheduler, worker, server_args, rank, group)
    raise ValueError(f"--disaggregation-mode {mode!r} has no PD component; use prefill, decode or null")
