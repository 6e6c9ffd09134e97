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
    pools.append(("target", worker.target_runner.token_to_kv_pool))
    if worker.draft_runner is not None:
        pools.append(("draft", worker.draft_runner.token_to_kv_pool))
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
