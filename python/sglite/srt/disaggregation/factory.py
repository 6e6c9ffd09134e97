"""The scheduler's PD component for --disaggregation-mode, built outside the classes it builds."""

from __future__ import annotations

from typing import Any

from sglite.srt.disaggregation.base import SchedulerDisagg


def create_disagg(scheduler: Any, worker: Any, server_args: Any, tp_rank: int, world_size: int) -> SchedulerDisagg:
    """PrefillHandoff (prefill), DecodePrealloc (decode), or the no-op component (null)."""
    mode = server_args.disaggregation_mode
    if mode in (None, "null"):
        return SchedulerDisagg()
    if getattr(server_args, "enable_dp_attention", False):
        # Ranks of different attention-DP groups run different schedules, so a TP-wide poll agreement
        # would pair unrelated requests.
        raise ValueError("--disaggregation-mode does not support --enable-dp-attention yet; drop one of them")
    tp_group = None
    if world_size > 1:
        from sglite.srt.distributed.parallel_state import get_tp_group

        tp_group = get_tp_group()
    if mode == "prefill":
        from sglite.srt.disaggregation.prefill import PrefillHandoff

        return PrefillHandoff.create(scheduler, worker, server_args, tp_rank, tp_group)
    if mode == "decode":
        from sglite.srt.disaggregation.decode import DecodePrealloc

        return DecodePrealloc.create(scheduler, worker, server_args, tp_rank, tp_group)
    raise ValueError(f"--disaggregation-mode {mode!r} has no PD component; use prefill, decode or null")
