"""The per-rank memory plan as a record: pool geometries, the solved ``PoolPlan`` and ``MemoryPoolConfig``.

This module owns what a plan *is*; how it is sized (the configurators, the device budget) lives in
``model_executor/pool_configurator.py`` and ``model_executor/kv_cache_configurator.py``. A geometry's
``cell_bytes()`` is the one price of a pool's token slot: the draft resolver, the configurators, the
planner and the pool builders all read it from here. The same ``PoolPlan`` gives the planned bytes of
every pool and builds the pools (on any device, ``meta`` included), so the plan and the allocation
cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import Any, Optional, Union

import torch

from sglite.srt.mem_cache.memory_pool import (
    BaseTokenToKVPool,
    DeferredContextRows,
    HybridLinearKVPool,
    MambaStatePool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    SWAKVPool,
)

REQ_TO_TOKEN_DTYPE = torch.int32

Device = Union[str, torch.device]


class MemoryPlanError(RuntimeError):
    """The budget cannot hold a usable pool, or the plan's inputs disagree; the message says what to change."""


# ====================================================================== per-rank geometries


@dataclass(frozen=True)
class AttnPoolGeometry:
    """One token pool's per-rank geometry: MHA (heads x dims) or MLA (latent), over some model layers."""

    kind: str  # "mha" | "mla"
    dtype: torch.dtype
    layer_ids: tuple[int, ...]
    head_num: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @property
    def num_layers(self) -> int:
        """Layers this pool holds."""
        return len(self.layer_ids)

    def cell_bytes(self) -> int:
        """Bytes per token slot over all layers of this pool."""
        if self.kind == "mha":
            return MHATokenToKVPool.cell_bytes(self.dtype, self.head_num, self.head_dim, self.v_head_dim, self.num_layers)
        return MLATokenToKVPool.cell_bytes(self.dtype, self.kv_lora_rank, self.qk_rope_head_dim, self.num_layers)

    def planned_bytes(self, size: int, page_size: int) -> int:
        """Bytes the pool allocates at ``size`` slots."""
        if self.kind == "mha":
            return MHATokenToKVPool.planned_bytes(
                size, page_size, self.dtype, self.head_num, self.head_dim, self.v_head_dim, self.num_layers
            )
        return MLATokenToKVPool.planned_bytes(
            size, page_size, self.dtype, self.kv_lora_rank, self.qk_rope_head_dim, self.num_layers
        )

    def build(self, size: int, page_size: int, device: Device) -> BaseTokenToKVPool:
        """Allocate the pool."""
        if self.kind == "mha":
            return MHATokenToKVPool(
                size, page_size, self.dtype, self.head_num, self.head_dim, self.v_head_dim,
                self.num_layers, device, layer_ids=self.layer_ids,
            )
        return MLATokenToKVPool(
            size, page_size, self.dtype, self.kv_lora_rank, self.qk_rope_head_dim,
            self.num_layers, device, layer_ids=self.layer_ids,
        )

    def with_layers(self, layer_ids: tuple[int, ...], dtype: Optional[torch.dtype] = None) -> "AttnPoolGeometry":
        """Same per-layer geometry over other layers (an EAGLE draft reusing the target's)."""
        return dataclasses.replace(self, layer_ids=tuple(layer_ids), dtype=dtype or self.dtype)


def attn_pool_geometry(
    model_config: Any, layer_ids: Any, dtype: torch.dtype, attn_tp_size: int, mla: bool = False
) -> AttnPoolGeometry:
    """A model's attention pool geometry on one rank at ``attn_tp_size``: MLA latent, or MHA heads per rank.

    Target and draft pools alike are described here, so a draft's price is its pool's ``cell_bytes()``."""
    if mla:
        return AttnPoolGeometry("mla", dtype, tuple(layer_ids), kv_lora_rank=model_config.kv_lora_rank,
                                qk_rope_head_dim=model_config.qk_rope_head_dim)
    return AttnPoolGeometry("mha", dtype, tuple(layer_ids), head_num=model_config.get_num_kv_heads(attn_tp_size),
                            head_dim=model_config.head_dim, v_head_dim=model_config.v_head_dim)


@dataclass(frozen=True)
class StateGeometry:
    """Per-rank recurrent state of the linear-attention layers."""

    layer_ids: tuple[int, ...]
    num_heads: int
    state_k_dim: int
    state_v_dim: int
    conv_channels: int
    conv_kernel: int
    ssm_dtype: torch.dtype
    conv_dtype: torch.dtype

    def _geom(self) -> tuple:
        return (self.num_heads, self.state_k_dim, self.state_v_dim, self.conv_channels, self.conv_kernel,
                self.ssm_dtype, self.conv_dtype)

    def bytes_per_slot(self) -> int:
        """Bytes of one request's state over all linear layers."""
        return MambaStatePool.bytes_per_slot(len(self.layer_ids), *self._geom())

    def planned_bytes(self, slots: int) -> int:
        """Bytes the state pool allocates at ``slots`` request slots."""
        return MambaStatePool.planned_bytes(slots, len(self.layer_ids), *self._geom())

    def build(self, slots: int, device: Device) -> MambaStatePool:
        """Allocate the state pool."""
        return MambaStatePool(slots, self.layer_ids, *self._geom(), device)


@dataclass(frozen=True)
class DeferredContextGeometry:
    """The DFLASH deferred context buffer: rows of draft-free steps' features waiting for their draft K/V write."""

    rows: int
    feature_width: int  # len(target_layer_ids) x the target's hidden size
    dtype: torch.dtype  # the runtime dtype the target's features come in

    def planned_bytes(self) -> int:
        """Bytes the buffer allocates."""
        return DeferredContextRows.planned_bytes(self.rows, self.feature_width, self.dtype)

    def build(self, device: Device) -> DeferredContextRows:
        """Allocate the buffer."""
        return DeferredContextRows(self.rows, self.feature_width, self.dtype, device)


# ====================================================================== the plan


@dataclass(frozen=True)
class PlannedPool:
    """One allocation of the plan and its exact bytes."""

    name: str
    role: str  # "target" | "draft" | "shared"
    planned_bytes: int


@dataclass(frozen=True)
class PoolPlan:
    """Per-rank geometries and solved sizes: planned bytes and pool construction from one place."""

    layout: str  # "default" | "hybrid_swa" | "hybrid_linear"
    page_size: int
    max_total_num_tokens: int  # full-attention token slots (what the allocator hands out)
    max_running_requests: int
    req_to_token_context_len: int
    target_attn: Optional[AttnPoolGeometry]  # full-attention (or MLA) layers of the target
    target_swa: Optional[AttnPoolGeometry] = None
    swa_max_total_num_tokens: Optional[int] = None
    target_state: Optional[StateGeometry] = None
    state_slots: Optional[int] = None
    draft: Optional[AttnPoolGeometry] = None
    extra_req_slots: int = 0  # PD decode node: rows for requests pre-allocated while their KV arrives
    # DFLASH/DSPARK whose decode steps may skip the draft: the rows those steps defer (None otherwise).
    draft_deferred_context: Optional[DeferredContextGeometry] = None

    @property
    def req_to_token_rows(self) -> int:
        """Request rows of the request→token table (running requests + PD pre-allocation rows)."""
        return self.max_running_requests + self.extra_req_slots

    # ---------------------------------------------------------------- bytes
    def planned_pools(self) -> list[PlannedPool]:
        """Every allocation with its exact bytes (what ``build_*`` will allocate)."""
        T, p = self.max_total_num_tokens, self.page_size
        out: list[PlannedPool] = []
        if self.layout == "hybrid_swa":
            parts = SWAKVPool.planned_bytes(
                T, self.swa_max_total_num_tokens, p, self.target_swa.dtype,
                self.target_attn.head_num, self.target_attn.head_dim, self.target_attn.v_head_dim,
                self.target_attn.num_layers,
                self.target_swa.head_num, self.target_swa.head_dim, self.target_swa.v_head_dim,
                self.target_swa.num_layers,
            )
            out += [
                PlannedPool("target_kv_full", "target", parts["full"]),
                PlannedPool("target_kv_swa", "target", parts["swa"]),
                PlannedPool("target_full_to_swa_mapping", "target", parts["mapping"]),
            ]
        elif self.layout == "hybrid_linear":
            out += [
                PlannedPool("target_kv", "target", self.target_attn.planned_bytes(T, p)),
                PlannedPool("target_linear_state", "target", self.target_state.planned_bytes(self.state_slots)),
            ]
        else:
            out.append(PlannedPool("target_kv", "target", self.target_attn.planned_bytes(T, p)))
        if self.draft is not None:
            out.append(PlannedPool("draft_kv", "draft", self.draft.planned_bytes(T, p)))
        if self.draft_deferred_context is not None:
            out.append(PlannedPool("draft_deferred_context", "draft", self.draft_deferred_context.planned_bytes()))
        out.append(
            PlannedPool(
                "req_to_token", "shared",
                ReqToTokenPool.planned_bytes(self.req_to_token_rows, self.req_to_token_context_len, REQ_TO_TOKEN_DTYPE),
            )
        )
        return out

    def total_bytes(self) -> int:
        """Sum over every planned allocation."""
        return sum(p.planned_bytes for p in self.planned_pools())

    # ---------------------------------------------------------------- builders
    def build_target_kv_pool(self, device: Device) -> Any:
        """The target's token→KV pool (MHA/MLA, SWA pair, or hybrid linear)."""
        T, p = self.max_total_num_tokens, self.page_size
        if self.layout == "hybrid_swa":
            a, s = self.target_attn, self.target_swa
            return SWAKVPool(
                T, self.swa_max_total_num_tokens, p, s.dtype,
                a.head_num, a.head_dim, a.v_head_dim, a.layer_ids,
                s.head_num, s.head_dim, s.v_head_dim, s.layer_ids, device,
            )
        if self.layout == "hybrid_linear":
            return HybridLinearKVPool(self.target_attn.build(T, p, device), self.target_state.build(self.state_slots, device))
        return self.target_attn.build(T, p, device)

    def build_draft_kv_pool(self, device: Device) -> BaseTokenToKVPool:
        """The draft's own KV pool at the target's token capacity (slot i = the same token)."""
        if self.draft is None:
            raise MemoryPlanError("this memory plan has no draft pool (no --speculative-algorithm was planned)")
        return self.draft.build(self.max_total_num_tokens, self.page_size, device)

    def build_draft_deferred_context(self, device: Device) -> Optional[DeferredContextRows]:
        """The DFLASH draft's deferred context buffer (None when no decode step may skip the draft)."""
        if self.draft_deferred_context is None:
            return None
        return self.draft_deferred_context.build(device)

    def build_req_to_token_pool(self, device: Device) -> ReqToTokenPool:
        """The request→token table shared by target and draft."""
        return ReqToTokenPool(self.req_to_token_rows, self.req_to_token_context_len, device, REQ_TO_TOKEN_DTYPE)


# ====================================================================== the plan record


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """'bfloat16' for torch.bfloat16 (JSON-friendly)."""
    return None if dtype is None else str(dtype).replace("torch.", "")


@dataclass
class MemoryPoolConfig:
    """The per-rank memory plan: capacities, cell sizes and the exact pools to build.

    Every field is JSON-friendly (``dataclasses.asdict`` goes straight to /get_server_info); the
    geometries to build from are in ``self.plan`` (a ``PoolPlan``, passed as ``pool_plan``).
    """

    max_total_num_tokens: int
    max_running_requests: int
    target_cell_bytes: int  # target KV bytes per token per rank (SWA: incl. the sliding share and mapping)
    draft_cell_bytes: int  # draft KV bytes per token per rank (0 without a draft)
    budget_bytes: int
    page_size: int
    context_len: int
    req_to_token_context_len: int
    kv_cache_dtype: str  # dtype_name of the target KV dtype
    attn_tp_size: int
    attn_dp_size: int
    configurator: str
    pool_plan: InitVar[PoolPlan]
    planned_pool_bytes: dict[str, int] = field(default_factory=dict)  # filled from the plan
    swa_max_total_num_tokens: Optional[int] = None
    mamba_state_slots: Optional[int] = None
    state_bytes_per_slot: Optional[int] = None
    speculative_algorithm: Optional[str] = None
    # How the draft was priced: "draft_geometry" (DFLASH/DSPARK: its own layers and heads) or "layer_ratio"
    # (EAGLE/STANDALONE: the target's per-layer cell); None without a draft. The pool builder checks by it.
    draft_pricing: Optional[str] = None
    draft_kv_cache_dtype: Optional[str] = None
    target_kv_heads_per_rank: Optional[int] = None  # None for MLA (latent, not per head)
    draft_kv_heads_per_rank: Optional[int] = None
    max_total_tokens_flag: Optional[int] = None

    def __post_init__(self, pool_plan: PoolPlan) -> None:
        if self.max_total_num_tokens <= 0:
            raise MemoryPlanError("Not enough memory: the plan has no KV tokens; raise the memory budget")
        self.plan = pool_plan  # not a field: asdict() stays JSON-friendly
        self.planned_pool_bytes = {p.name: p.planned_bytes for p in pool_plan.planned_pools()}

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The target KV dtype as a torch dtype (the field holds its name)."""
        return getattr(torch, self.kv_cache_dtype)

    @property
    def draft_kv_cache_torch_dtype(self) -> Optional[torch.dtype]:
        """The draft KV dtype as a torch dtype (None without a draft)."""
        return None if self.draft_kv_cache_dtype is None else getattr(torch, self.draft_kv_cache_dtype)

    @property
    def max_context_len(self) -> int:
        """Columns of the request→token table (context length plus speculative/page slack)."""
        return self.req_to_token_context_len

    def planned_pools(self) -> list[PlannedPool]:
        """Every allocation of the plan with its exact bytes."""
        return self.plan.planned_pools()

    def planned_total_bytes(self) -> int:
        """Sum of all planned allocations (<= budget_bytes)."""
        return self.plan.total_bytes()
