"""Pool configurators: per-token cell sizes and page-aligned pool sizes solved from a byte budget.

One configurator per target layout (``DefaultPoolConfigurator`` for MHA/GQA and MLA,
``HybridSWAPoolConfigurator``, ``HybridLinearPoolConfigurator``); each prices the draft:
DFLASH/DSPARK exactly from the draft's own geometry at the live ``attn_tp_size``, EAGLE/STANDALONE by
the layer ratio ``ceil(attn_cell * (L + D) / L)`` over the target's attention layers.

The result is a ``PoolPlan``: the per-rank geometries plus sizes. The same ``PoolPlan`` gives the
planned bytes of every pool and builds the pools (on any device, ``meta`` included), so the plan and
the allocation cannot drift apart. Sizes are solved by searching the largest page multiple whose
*exact* total (padding pages, page-aligned sliding pool, request table, recurrent state) fits the
budget; the closed form ``budget // cell`` is the starting upper bound.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from sglite.srt.configs.model_config import AttentionKind, ModelConfig
from sglite.srt.mem_cache.kv_cache_dtype import kv_dtype_bytes
from sglite.srt.mem_cache.memory_pool import (
    BaseTokenToKVPool,
    HybridLinearKVPool,
    MambaStatePool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    SWAKVPool,
)
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
    DFLASH_FAMILY,
    LAYER_RATIO_FAMILY,
    SpecAuxHiddenStateConfig,
)
from sglite.srt.runtime_context import get_parallel

DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8
# Share of the budget the recurrent-state pool may take in a hybrid linear model (SGLang's
# mamba_full_memory_ratio 0.9: state / KV = 0.9).
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9
MAMBA_SSM_DTYPE = torch.float32  # recurrent state accumulates over the whole sequence: keep fp32
REQ_TO_TOKEN_DTYPE = torch.int32
MIN_RUNNING_REQUESTS_ESTIMATE, MAX_RUNNING_REQUESTS_ESTIMATE = 2048, 4096

Device = Union[str, torch.device]


class MemoryPlanError(RuntimeError):
    """The budget cannot hold a usable pool, or the plan's inputs disagree; the message says what to change."""


def floor_to_page(n: int, page_size: int) -> int:
    """Largest multiple of ``page_size`` that is <= n (0 for n < page_size)."""
    return max(0, n) // page_size * page_size


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

    def build_req_to_token_pool(self, device: Device) -> ReqToTokenPool:
        """The request→token table shared by target and draft."""
        return ReqToTokenPool(self.req_to_token_rows, self.req_to_token_context_len, device, REQ_TO_TOKEN_DTYPE)


# ====================================================================== configurators


@dataclass(frozen=True)
class ConfiguratorInputs:
    """Everything a configurator needs besides the budget."""

    model_config: ModelConfig
    kv_cache_dtype: torch.dtype
    model_dtype: torch.dtype  # runtime dtype (short-conv state of linear layers)
    page_size: int
    context_len: int
    spec_aux: SpecAuxHiddenStateConfig
    num_draft_tokens: int = 0
    max_running_requests: Optional[int] = None  # --max-running-requests (whole server; split over attn DP)
    extra_req_slots: int = 0  # PD decode node: --disaggregation-decode-extra-slots
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    mamba_full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO


class BasePoolConfigurator(abc.ABC):
    """Cell sizes at the live attention widths, and sizes solved from a byte budget."""

    name = "base"

    def __init__(self, inputs: ConfiguratorInputs) -> None:
        par = get_parallel()
        self.inputs = inputs
        self.model_config = inputs.model_config
        self.page_size = inputs.page_size
        self.attn_tp_size = int(par.attn_tp_size)  # live width: the one the pool builders use
        self.attn_dp_size = int(par.attn_dp_size)
        self.target_attn = self._target_attn_geometry()
        self.draft = self._draft_geometry()
        self.req_to_token_context_len = inputs.context_len + self._extra_context_len()

    # ---------------------------------------------------------------- geometry
    def _attn_geometry(self, layer_ids: list[int], mla: bool) -> AttnPoolGeometry:
        mc, dtype = self.model_config, self.inputs.kv_cache_dtype
        if mla:
            return AttnPoolGeometry("mla", dtype, tuple(layer_ids), kv_lora_rank=mc.kv_lora_rank,
                                    qk_rope_head_dim=mc.qk_rope_head_dim)
        return AttnPoolGeometry("mha", dtype, tuple(layer_ids), head_num=mc.get_num_kv_heads(self.attn_tp_size),
                                head_dim=mc.head_dim, v_head_dim=mc.v_head_dim)

    @abc.abstractmethod
    def _target_attn_geometry(self) -> AttnPoolGeometry:
        """Geometry of the target's full-attention (or MLA) layers."""

    def _extra_context_len(self) -> int:
        # Verify/draft blocks write up to num_draft_tokens past the context; paged allocation may round up.
        extra = 4 + self.inputs.num_draft_tokens
        if self.inputs.spec_aux.has_draft and self.page_size > 1:
            extra += self.page_size - 1
        return extra

    def _draft_geometry(self) -> Optional[AttnPoolGeometry]:
        aux = self.inputs.spec_aux
        if not aux.has_draft:
            return None
        if aux.attn_tp_size != self.attn_tp_size:
            raise MemoryPlanError(
                f"the draft was priced at attn_tp_size={aux.attn_tp_size} but the pools are built at "
                f"attn_tp_size={self.attn_tp_size}; resolve_spec_aux_hidden_state must run after init_parallel_runtime"
            )
        if aux.algorithm in DFLASH_FAMILY:
            geom = AttnPoolGeometry(
                "mha", aux.draft_kv_cache_dtype, tuple(range(aux.draft_num_layers)),
                head_num=aux.draft_kv_heads_per_rank, head_dim=aux.draft_head_dim, v_head_dim=aux.draft_v_head_dim,
            )
            cell = aux.dflash_draft_cell_size_per_token
            if cell is None or cell <= 0:
                raise MemoryPlanError(
                    f"{aux.algorithm} draft has no positive per-token price ({cell}); a draft pool that will be "
                    "allocated cannot be planned at zero bytes"
                )
            if cell != geom.cell_bytes():
                raise MemoryPlanError(f"draft price {cell} B/token != draft pool geometry {geom.cell_bytes()} B/token")
            return geom
        if aux.algorithm in LAYER_RATIO_FAMILY:
            if aux.draft_kv_cache_dtype != self.inputs.kv_cache_dtype:
                raise MemoryPlanError(
                    f"{aux.algorithm} drafts are priced by the target's layer ratio, which needs the draft KV dtype "
                    f"({aux.draft_kv_cache_dtype}) to equal the target's ({self.inputs.kv_cache_dtype}); "
                    "drop --speculative-draft-kv-cache-dtype"
                )
            return self.target_attn.with_layers(tuple(range(aux.eagle_draft_num_layers)))
        raise MemoryPlanError(f"unknown speculative algorithm {aux.algorithm!r}")

    # ---------------------------------------------------------------- cells
    @abc.abstractmethod
    def target_cell_bytes(self) -> int:
        """Target KV bytes per (full) token per rank, including the sliding pool's share and the mapping."""

    def draft_cell_bytes(self) -> int:
        """Draft KV bytes per token per rank (0 without a draft)."""
        aux = self.inputs.spec_aux
        if not aux.has_draft:
            return 0
        if aux.algorithm in DFLASH_FAMILY:
            return int(aux.dflash_draft_cell_size_per_token)
        # Layer ratio over the target's attention layers: ceil(attn_cell * (L + D) / L) - attn_cell.
        attn_cell, L, D = self.target_attn.cell_bytes(), self.target_attn.num_layers, aux.eagle_draft_num_layers
        if L <= 0 or attn_cell <= 0:
            raise MemoryPlanError(f"{aux.algorithm} draft: the target has no attention layers to take a ratio over")
        draft_cell = -(-attn_cell * (L + D) // L) - attn_cell
        if draft_cell != self.draft.cell_bytes():
            raise MemoryPlanError(
                f"{aux.algorithm} layer-ratio price {draft_cell} B/token != draft pool {self.draft.cell_bytes()} B/token"
            )
        return draft_cell

    def cell_bytes(self) -> int:
        """Target + draft bytes per token per rank."""
        return self.target_cell_bytes() + self.draft_cell_bytes()

    # ---------------------------------------------------------------- sizes
    def max_running_requests_for(self, tokens: int) -> int:
        """Request rows for a token capacity (SGLang's rule; the flag is split over attention-DP ranks)."""
        mrr = self.inputs.max_running_requests
        if mrr is not None:
            want = max(1, mrr // self.attn_dp_size)
        else:
            est = int(tokens / self.inputs.context_len * 512)
            want = min(max(est, MIN_RUNNING_REQUESTS_ESTIMATE), MAX_RUNNING_REQUESTS_ESTIMATE)
        return max(1, min(want, tokens // 2))

    def plan_for_tokens(self, tokens: int) -> PoolPlan:
        """The plan at a given full-token capacity (a page multiple)."""
        return PoolPlan(
            layout="default",
            page_size=self.page_size,
            max_total_num_tokens=tokens,
            max_running_requests=self.max_running_requests_for(tokens),
            extra_req_slots=self.inputs.extra_req_slots,
            req_to_token_context_len=self.req_to_token_context_len,
            target_attn=self.target_attn,
            draft=self.draft,
        )

    def _budget_for_tokens(self, budget_bytes: int) -> int:
        return budget_bytes

    def solve(self, budget_bytes: int, max_total_tokens: Optional[int] = None) -> PoolPlan:
        """Largest page-aligned plan whose exact total fits ``budget_bytes`` (``max_total_tokens`` only lowers it)."""
        p = self.page_size
        cell = self.cell_bytes()
        if cell <= 0:
            raise MemoryPlanError(f"{self.name}: per-token cell is {cell} B; nothing to size")
        budget = self._budget_for_tokens(budget_bytes)
        hi_pages = max(0, budget) // (cell * p) + 1  # closed-form bound: budget // cell tokens
        fits: Callable[[int], bool] = lambda k: self.plan_for_tokens(k * p).total_bytes() <= budget_bytes
        lo = 0
        if not fits(1):
            one = self.plan_for_tokens(p)
            raise MemoryPlanError(
                f"not enough memory for the KV pools: budget {budget_bytes} B < {one.total_bytes()} B needed for one "
                f"page of {p} tokens ({self.name}, {cell} B/token); raise --mem-fraction-static (CUDA) or "
                "--cpu-kv-cache-budget-mb (CPU), or lower --context-length / --max-running-requests"
            )
        lo, hi = 1, hi_pages
        while fits(hi):  # the bound is loose only for rounding terms; widen if ever needed
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        tokens = lo * p
        if max_total_tokens is not None:
            tokens = min(tokens, floor_to_page(max_total_tokens, p))
            if tokens <= 0:
                raise MemoryPlanError(f"--max-total-tokens {max_total_tokens} is below one page ({p} tokens)")
        plan = self.plan_for_tokens(tokens)
        self._validate(plan)
        return plan

    def _validate(self, plan: PoolPlan) -> None:
        """Layout-specific checks on a solved plan."""


class DefaultPoolConfigurator(BasePoolConfigurator):
    """All layers MHA/GQA, or all layers MLA."""

    name = "default"

    def _target_attn_geometry(self) -> AttnPoolGeometry:
        mc = self.model_config
        kinds = set(mc.layer_kinds)
        if kinds == {AttentionKind.FULL}:
            return self._attn_geometry(list(range(mc.num_hidden_layers)), mla=False)
        if kinds == {AttentionKind.MLA}:
            return self._attn_geometry(list(range(mc.num_hidden_layers)), mla=True)
        raise MemoryPlanError(f"DefaultPoolConfigurator cannot price layer kinds {sorted(k.value for k in kinds)}")

    def target_cell_bytes(self) -> int:
        """KV bytes per token per rank over all layers."""
        return self.target_attn.cell_bytes()


class HybridSWAPoolConfigurator(BasePoolConfigurator):
    """Full layers in a pool of T slots, sliding layers in a pool of ``align(int(T * ratio))`` slots."""

    name = "hybrid_swa"

    def __init__(self, inputs: ConfiguratorInputs) -> None:
        super().__init__(inputs)
        mc = self.model_config
        swa_ids = mc.layer_ids(AttentionKind.SLIDING)
        heads = mc.get_swa_num_kv_heads(self.attn_tp_size)
        hd = mc.swa_head_dim or mc.head_dim
        self.target_swa = AttnPoolGeometry("mha", inputs.kv_cache_dtype, tuple(swa_ids), head_num=heads,
                                           head_dim=hd, v_head_dim=mc.swa_head_dim or mc.v_head_dim)
        # With no full layer the sliding pool is the only pool: it takes the whole capacity.
        self.ratio = inputs.swa_full_tokens_ratio if self.target_attn.num_layers else 1.0
        if not 0.0 < self.ratio <= 1.0:
            raise MemoryPlanError(f"swa_full_tokens_ratio must be in (0, 1], got {self.ratio}")

    def _target_attn_geometry(self) -> AttnPoolGeometry:
        mc = self.model_config
        other = set(mc.layer_kinds) - {AttentionKind.FULL, AttentionKind.SLIDING}
        if other:
            raise MemoryPlanError(f"HybridSWAPoolConfigurator cannot price layer kinds {sorted(k.value for k in other)}")
        return self._attn_geometry(mc.layer_ids(AttentionKind.FULL), mla=False)

    def target_cell_bytes(self) -> int:
        """Full layers + ratio x sliding layers + the 8-byte full→swa mapping entry, per full token."""
        mapping = kv_dtype_bytes(SWAKVPool.MAPPING_DTYPE)
        return self.target_attn.cell_bytes() + int(-(-self.ratio * self.target_swa.cell_bytes() // 1)) + mapping

    def swa_tokens_for(self, tokens: int) -> int:
        """Sliding-pool slots for a full-token capacity."""
        return floor_to_page(int(tokens * self.ratio), self.page_size)

    def plan_for_tokens(self, tokens: int) -> PoolPlan:
        """The plan at a full-token capacity."""
        base = super().plan_for_tokens(tokens)
        return dataclasses.replace(
            base, layout="hybrid_swa", target_swa=self.target_swa, swa_max_total_num_tokens=self.swa_tokens_for(tokens)
        )

    def _validate(self, plan: PoolPlan) -> None:
        window = self.model_config.sliding_window or 0
        if plan.swa_max_total_num_tokens < window + self.page_size:
            raise MemoryPlanError(
                f"the sliding-window pool ({plan.swa_max_total_num_tokens} tokens) cannot hold one window "
                f"({window}) plus a page ({self.page_size}); raise the memory budget or --swa-full-tokens-ratio"
            )


class HybridLinearPoolConfigurator(BasePoolConfigurator):
    """Attention layers' KV over T tokens plus per-request recurrent state of the linear layers."""

    name = "hybrid_linear"

    def __init__(self, inputs: ConfiguratorInputs) -> None:
        super().__init__(inputs)
        mc = self.model_config
        ls = mc.linear_state
        if ls is None:
            raise MemoryPlanError(f"{mc.model_type}: linear layers without a recurrent-state geometry")
        w = self.attn_tp_size
        self.target_state = StateGeometry(
            layer_ids=tuple(mc.layer_ids(AttentionKind.LINEAR)),
            num_heads=max(1, ls.num_heads // w),
            state_k_dim=ls.state_k_dim,
            state_v_dim=ls.state_v_dim,
            conv_channels=max(1, ls.conv_channels // w),
            conv_kernel=ls.conv_kernel,
            ssm_dtype=MAMBA_SSM_DTYPE,
            conv_dtype=inputs.model_dtype,
        )
        self._state_slots: Optional[int] = None

    def _target_attn_geometry(self) -> AttnPoolGeometry:
        mc = self.model_config
        full, mla = mc.layer_ids(AttentionKind.FULL), mc.layer_ids(AttentionKind.MLA)
        if full and mla:
            raise MemoryPlanError("a hybrid linear model with both MHA and MLA attention layers is not supported")
        if set(mc.layer_kinds) - {AttentionKind.FULL, AttentionKind.MLA, AttentionKind.LINEAR}:
            raise MemoryPlanError("HybridLinearPoolConfigurator cannot price sliding layers")
        if not (full or mla):
            raise MemoryPlanError(f"{mc.model_type}: no attention layers; a pure recurrent model is not supported")
        return self._attn_geometry(mla or full, mla=bool(mla))

    def target_cell_bytes(self) -> int:
        """Attention layers' KV bytes per token (recurrent state is priced per request slot, not per token)."""
        return self.target_attn.cell_bytes()

    def state_slots_for_budget(self, budget_bytes: int) -> int:
        """Request state slots: the flag per attention-DP rank, else the state share of the budget."""
        per_slot = self.target_state.bytes_per_slot()
        if self.inputs.max_running_requests is not None:
            return max(1, self.inputs.max_running_requests // self.attn_dp_size)
        m = self.inputs.mamba_full_memory_ratio
        share = int(budget_bytes * m / (1 + m))
        return max(1, min(share // per_slot - 1, MAX_RUNNING_REQUESTS_ESTIMATE))

    def max_running_requests_for(self, tokens: int) -> int:
        """Request rows, capped by the state slots (each running request holds one)."""
        return min(super().max_running_requests_for(tokens), self._state_slots)

    def plan_for_tokens(self, tokens: int) -> PoolPlan:
        """The plan at a token capacity, with the state slots fixed by ``solve``."""
        base = super().plan_for_tokens(tokens)
        return dataclasses.replace(base, layout="hybrid_linear", target_state=self.target_state,
                                   state_slots=self._state_slots)

    def _budget_for_tokens(self, budget_bytes: int) -> int:
        return budget_bytes - self.target_state.planned_bytes(self._state_slots)

    def solve(self, budget_bytes: int, max_total_tokens: Optional[int] = None) -> PoolPlan:
        """Fix the state slots from the budget, then solve the KV tokens from what is left."""
        self._state_slots = self.state_slots_for_budget(budget_bytes)
        if self.target_state.planned_bytes(self._state_slots) >= budget_bytes:
            raise MemoryPlanError(
                f"the recurrent state of {self._state_slots} requests "
                f"({self.target_state.planned_bytes(self._state_slots)} B) does not fit the budget {budget_bytes} B; "
                "lower --max-running-requests or raise the memory budget"
            )
        plan = super().solve(budget_bytes, max_total_tokens)
        # State slots beyond what the token capacity can run would sit idle: shrink them to the running
        # cap and give the freed bytes back to the KV tokens (the cap only grows with tokens, so this settles).
        for _ in range(4):
            if plan.max_running_requests >= self._state_slots:
                break
            self._state_slots = plan.max_running_requests
            plan = super().solve(budget_bytes, max_total_tokens)
        return plan


def select_pool_configurator_class(model_config: ModelConfig) -> type[BasePoolConfigurator]:
    """Configurator for a model's layer layout."""
    if model_config.is_hybrid_linear:
        return HybridLinearPoolConfigurator
    if model_config.is_hybrid_swa:
        return HybridSWAPoolConfigurator
    return DefaultPoolConfigurator


def create_pool_configurator(inputs: ConfiguratorInputs) -> BasePoolConfigurator:
    """Build the configurator for ``inputs.model_config`` (reads the live parallel widths)."""
    return select_pool_configurator_class(inputs.model_config)(inputs)
