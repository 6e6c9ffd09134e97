"""Pool configurators: per-token cell sizes and page-aligned pool sizes solved from a byte budget.

One configurator per target layout (``DefaultPoolConfigurator`` for MHA/GQA and MLA,
``HybridSWAPoolConfigurator``, ``HybridLinearPoolConfigurator``). The draft is priced by its pool
geometry's ``cell_bytes()`` (``SpecAuxHiddenStateConfig.draft_geometry``, resolved at the live
``attn_tp_size``): DFLASH/DSPARK with the draft's own geometry, EAGLE/STANDALONE with the target's
per-layer geometry over the draft's layers (the layer ratio), which must equal the draft's own.

The result is a ``PoolPlan`` (``mem_cache/pool_plan.py``): the per-rank geometries plus sizes. Sizes
are solved by searching the largest page multiple whose
*exact* total (padding pages, page-aligned sliding pool, request table, recurrent state) fits the
budget; the closed form ``budget // cell`` is the starting upper bound.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglite.srt.configs.model_config import AttentionKind, ModelConfig
from sglite.srt.mem_cache.kv_cache_dtype import kv_dtype_bytes
from sglite.srt.mem_cache.memory_pool import SWAKVPool
from sglite.srt.mem_cache.paging import floor_to_page
from sglite.srt.mem_cache.pool_plan import (
    AttnPoolGeometry,
    DeferredContextGeometry,
    MemoryPlanError,
    PoolPlan,
    StateGeometry,
    attn_pool_geometry,
)
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
from sglite.srt.runtime_context import get_parallel

DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8
# Share of the budget the recurrent-state pool may take in a hybrid linear model (SGLang's
# mamba_full_memory_ratio 0.9: state / KV = 0.9).
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9
MAMBA_SSM_DTYPE = torch.float32  # recurrent state accumulates over the whole sequence: keep fp32
MIN_RUNNING_REQUESTS_ESTIMATE, MAX_RUNNING_REQUESTS_ESTIMATE = 2048, 4096
# Rows of the DFLASH deferred context buffer (draft-free steps' features waiting for one batched draft K/V
# write): few enough to keep it small (the default pair's 4 x 576 fp32 features: 2.4 MB), many enough that
# one catch-up writes many rows per GEMM. The worker flushes before a step that would not fit, so this is
# the worst case; a step wider than the whole buffer is written at once.
MAX_DEFERRED_CONTEXT_ROWS = 256


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
    # DFLASH/DSPARK decode steps may skip the draft (--speculative-adaptive / --speculative-disable-by-batch-size,
    # not on a PD prefill node): they defer their draft context rows into a planned buffer.
    draft_free_steps: bool = False
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
        self.deferred_context = self._deferred_context_geometry()
        self.req_to_token_context_len = inputs.context_len + self._extra_context_len()

    # ---------------------------------------------------------------- geometry
    def _attn_geometry(self, layer_ids: list[int], mla: bool) -> AttnPoolGeometry:
        return attn_pool_geometry(self.model_config, layer_ids, self.inputs.kv_cache_dtype, self.attn_tp_size, mla)

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
        self.draft_pricing: Optional[str] = None
        if not aux.has_draft:
            return None
        if aux.attn_tp_size != self.attn_tp_size:
            raise MemoryPlanError(
                f"the draft was priced at attn_tp_size={aux.attn_tp_size} but the pools are built at "
                f"attn_tp_size={self.attn_tp_size}; resolve_spec_aux_hidden_state must run after init_parallel_runtime"
            )
        own = aux.draft_geometry
        self.draft_pricing = "draft_geometry" if aux.is_dflash_family else "layer_ratio"
        if own is None or own.cell_bytes() <= 0:
            raise MemoryPlanError(
                f"{aux.algorithm} draft has no positive per-token price; a draft pool that will be "
                "allocated cannot be planned at zero bytes"
            )
        if aux.is_dflash_family:
            return own
        # EAGLE/STANDALONE: the target's per-layer geometry over the draft's layers (the layer ratio); exact
        # only when a draft layer costs what a target attention layer costs, so check it against the draft's own.
        if aux.draft_kv_cache_dtype != self.inputs.kv_cache_dtype:
            raise MemoryPlanError(
                f"{aux.algorithm} drafts are priced by the target's layer ratio, which needs the draft KV dtype "
                f"({aux.draft_kv_cache_dtype}) to equal the target's ({self.inputs.kv_cache_dtype}); "
                "drop --speculative-draft-kv-cache-dtype"
            )
        ratio = self.target_attn.with_layers(own.layer_ids)
        if ratio.cell_bytes() != own.cell_bytes():
            raise MemoryPlanError(
                f"{aux.algorithm} layer-ratio price {ratio.cell_bytes()} B/token != the draft's own geometry "
                f"{own.cell_bytes()} B/token; the draft does not share the target's attention geometry"
            )
        return ratio

    def _deferred_context_geometry(self) -> Optional[DeferredContextGeometry]:
        """The deferred context buffer of draft-free DFLASH steps: the target's captured features, per rank.

        Every rank holds the full hidden width (TP all-reduces it; DP attention ranks defer their own
        requests' rows), so the buffer is the same on every rank."""
        if not self.inputs.draft_free_steps:
            return None
        aux = self.inputs.spec_aux
        if not aux.is_dflash_family:
            raise MemoryPlanError(f"draft-free decode steps need a DFLASH or DSPARK draft, not {aux.algorithm}")
        width = len(aux.target_layer_ids) * int(self.model_config.hidden_size)
        return DeferredContextGeometry(MAX_DEFERRED_CONTEXT_ROWS, width, self.inputs.model_dtype)

    # ---------------------------------------------------------------- cells
    @abc.abstractmethod
    def target_cell_bytes(self) -> int:
        """Target KV bytes per (full) token per rank, including the sliding pool's share and the mapping."""

    def draft_cell_bytes(self) -> int:
        """Draft KV bytes per token per rank (0 without a draft): the draft pool geometry's own price."""
        return self.draft.cell_bytes() if self.draft is not None else 0

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
            draft_deferred_context=self.deferred_context,
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
