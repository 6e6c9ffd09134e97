"""Shared PD helpers: which KV buffers travel, and agreeing on a room's state across TP ranks."""

from __future__ import annotations

from typing import Any, Optional

from sglite.srt.disaggregation.base import KVBufferSpec, KVPoll, buffer_specs_from_tensors
from sglite.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

# Pools whose every buffer row i holds global slot i, so slot-row copies move a request's KV exactly.
_SLOT_INDEXED_POOLS = (MHATokenToKVPool, MLATokenToKVPool)


def transferable_kv_buffers(worker: Any) -> list[KVBufferSpec]:
    """Target KV buffers, then DFLASH/DSPARK draft KV buffers: one list, one transfer."""
    pools: list[tuple[str, Any]] = []
    target = getattr(worker, "model_runner", None) or getattr(worker, "target_runner")
    pools.append(("target", target.token_to_kv_pool))
    draft = getattr(worker, "draft_runner", None)
    if draft is not None:
        pools.append(("draft", draft.token_to_kv_pool))
    named = []
    for prefix, pool in pools:
        if not isinstance(pool, _SLOT_INDEXED_POOLS):
            raise ValueError(
                f"PD disaggregation moves slot-indexed KV pools (MHA, MLA); the {prefix} pool is "
                f"{type(pool).__name__}. Serve this model without --disaggregation-mode"
            )
        named += [(f"{prefix}.{i}", t) for i, t in enumerate(pool.buffers())]
    return buffer_specs_from_tensors(named)


def agree_poll(state: KVPoll, tp_group: Optional[Any]) -> KVPoll:
    """The group's state of a room: the MIN over TP ranks (one rank still transferring holds all back)."""
    if tp_group is None or getattr(tp_group, "world_size", 1) == 1:
        return state
    return KVPoll(min(int(s) for s in tp_group.all_gather_object(int(state))))


def create_disagg(scheduler: Any, worker: Any, server_args: Any, tp_rank: int, world_size: int) -> Any:
    """The scheduler's PD component for --disaggregation-mode: PrefillHandoff or DecodePrealloc."""
    if getattr(server_args, "enable_dp_attention", False):
        # Ranks of different attention-DP groups run different schedules, so a TP-wide poll agreement
        # would pair unrelated requests.
        raise ValueError("--disaggregation-mode does not support --enable-dp-attention yet; drop one of them")
    tp_group = None
    if world_size > 1:
        from sglite.srt.distributed.parallel_state import get_tp_group

        tp_group = get_tp_group()
    mode = server_args.disaggregation_mode
    if mode == "prefill":
        from sglite.srt.disaggregation.prefill import PrefillHandoff

        return PrefillHandoff.create(scheduler, worker, server_args, tp_rank, tp_group)
    if mode == "decode":
        from sglite.srt.disaggregation.decode import DecodePrealloc

        return DecodePrealloc.create(scheduler, worker, server_args, tp_rank, tp_group)
    raise ValueError(f"--disaggregation-mode {mode!r} has no PD component; use prefill or decode")
