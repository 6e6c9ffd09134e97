"""KVCacheConfigurator: byte budget → ``MemoryPoolConfig`` (via a pool configurator) → real pools.

The target runner measures free memory before loading weights and calls ``configure``; the draft
runner passes the target's ``MemoryPoolConfig`` and gets it back verbatim (it never sizes itself).
``build_pools`` allocates exactly the pools the plan priced, on any device (``meta`` for
``sglite plan``). Budget:

- CUDA: ``int(free_before_weights * mem_fraction_static) - weights_bytes``; ``free_before_weights``
  is the MIN over the TP group, and the budget itself is MIN-reduced so every rank plans the same
  capacity.
- CPU: ``--cpu-kv-cache-budget-mb`` MiB (CPU has no memory profile; the default keeps tests small).

``--max-total-tokens`` only ever lowers the solved capacity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from sglite.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype, model_runtime_dtype
from sglite.srt.mem_cache.memory_pool import DeferredContextRows, ReqToTokenPool
from sglite.srt.mem_cache.pool_plan import MemoryPlanError, MemoryPoolConfig, dtype_name
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
    SpecAuxHiddenStateConfig,
    resolve_spec_aux_hidden_state,
)
from sglite.srt.model_executor.pool_configurator import (
    DEFAULT_MAMBA_FULL_MEMORY_RATIO,
    DEFAULT_SWA_FULL_TOKENS_RATIO,
    ConfiguratorInputs,
    create_pool_configurator,
)
from sglite.srt.runtime_context import get_parallel

logger = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30


# ====================================================================== budget


def resolve_model_dtype(dtype_flag: str, model_config: ModelConfig) -> torch.dtype:
    """Runtime dtype (``model_runtime_dtype``); an unknown one is a plan error."""
    try:
        return model_runtime_dtype(dtype_flag, model_config)
    except ValueError as e:
        raise MemoryPlanError(str(e)) from e


def get_free_device_memory(device: str) -> int:
    """Free bytes on this rank's device (CUDA only: CPU has no memory profile, it uses a flag)."""
    if torch.device(device).type != "cuda":
        raise MemoryPlanError(f"free-memory profiling needs CUDA; on {device} pass --cpu-kv-cache-budget-mb")
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def min_across_group(value: int, group: Any) -> int:
    """MIN of an integer over a ``GroupCoordinator`` (identity for None or a 1-rank group)."""
    if group is None:
        return int(value)
    return int(min(group.all_gather_object(int(value))))


@dataclass(frozen=True)
class KVBudgetInputs:
    """What the KV byte budget is resolved from; every field optional, see ``resolve_budget_bytes``.

    An explicit ``budget_bytes`` wins. On CUDA: ``pre_model_load_free_bytes`` (free memory before the
    weights load, MIN over ranks) and either ``weights_bytes`` or this rank's
    ``post_model_load_free_bytes`` (then weights = before - after). ``tp_group`` MIN-reduces the result.
    """

    budget_bytes: Optional[int] = None
    pre_model_load_free_bytes: Optional[int] = None
    weights_bytes: Optional[int] = None
    post_model_load_free_bytes: Optional[int] = None
    tp_group: Any = None


def compute_device_budget_bytes(pre_model_load_free_bytes: int, weights_bytes: int, mem_fraction_static: float) -> int:
    """KV budget on a device: the static share of the memory free before weights, minus the weights."""
    return int(pre_model_load_free_bytes * mem_fraction_static) - int(weights_bytes)


# ====================================================================== configurator


class KVCacheConfigurator:
    """Turns a budget into a ``MemoryPoolConfig``; the draft worker reuses the target's."""

    def __init__(
        self,
        server_args: Any,
        model_config: ModelConfig,
        spec_aux_config: Optional[SpecAuxHiddenStateConfig] = None,
        *,
        model_dtype: Optional[torch.dtype] = None,
        is_draft: bool = False,
        target_memory_pool_config: Optional[MemoryPoolConfig] = None,
        device: Optional[str] = None,
        swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
        mamba_full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO,
    ) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.spec_aux_config = spec_aux_config if spec_aux_config is not None else SpecAuxHiddenStateConfig()
        self.model_dtype = model_dtype or resolve_model_dtype(server_args.dtype, model_config)
        self.is_draft = is_draft
        self.target_memory_pool_config = target_memory_pool_config
        self.device = device or server_args.resolved_device()
        self.swa_full_tokens_ratio = swa_full_tokens_ratio
        self.mamba_full_memory_ratio = mamba_full_memory_ratio

    # ---------------------------------------------------------------- budget
    def resolve_budget_bytes(self, inputs: KVBudgetInputs = KVBudgetInputs()) -> int:
        """Budget from an explicit value, the CUDA profile, or the CPU flag; MIN over ``inputs.tp_group``."""
        sa = self.server_args
        budget_bytes, weights_bytes = inputs.budget_bytes, inputs.weights_bytes
        pre_free, post_free = inputs.pre_model_load_free_bytes, inputs.post_model_load_free_bytes
        if budget_bytes is None:
            if torch.device(self.device).type == "cuda":
                if weights_bytes is None and pre_free is not None and post_free is not None:
                    weights_bytes = pre_free - post_free
                if pre_free is None or weights_bytes is None:
                    raise MemoryPlanError(
                        "on CUDA the KV budget needs pre_model_load_free_bytes (free memory before weights load, "
                        "MIN over ranks) and weights_bytes or post_model_load_free_bytes"
                    )
                budget_bytes = compute_device_budget_bytes(pre_free, weights_bytes, sa.mem_fraction_static)
            else:
                budget_bytes = int(sa.cpu_kv_cache_budget_mb) * MiB
        budget_bytes = min_across_group(budget_bytes, inputs.tp_group)
        if budget_bytes <= 0:
            raise MemoryPlanError(
                f"no memory left for the KV pools (budget {budget_bytes} B after weights); raise "
                "--mem-fraction-static or use more GPUs (--tp-size)"
            )
        return budget_bytes

    def _num_draft_tokens(self) -> int:
        """Verify columns a decode step writes past the context (the resolver's verify width; 0 on a PD prefill node)."""
        if self.server_args.disaggregation_mode == "prefill":  # PD: a prefill node never verifies
            return 0
        return self.spec_aux_config.num_verify_tokens

    def _draft_free_steps(self) -> bool:
        """Whether DFLASH/DSPARK decode steps may skip the draft, deferring their context rows (never on a PD prefill node)."""
        sa = self.server_args
        if sa.disaggregation_mode == "prefill" or not self.spec_aux_config.is_dflash_family:
            return False
        return bool(sa.speculative_adaptive) or sa.speculative_disable_by_batch_size is not None

    # ---------------------------------------------------------------- configure
    def configure(self, budget: KVBudgetInputs = KVBudgetInputs()) -> MemoryPoolConfig:
        """Solve the per-rank plan (target), or return the target's plan verbatim (draft)."""
        if self.is_draft:
            if self.target_memory_pool_config is None:
                raise MemoryPlanError("a draft runner never sizes itself: pass target_memory_pool_config")
            return self.target_memory_pool_config
        sa, mc, aux = self.server_args, self.model_config, self.spec_aux_config
        if sa.speculative_algorithm != aux.algorithm:
            raise MemoryPlanError(
                f"--speculative-algorithm {sa.speculative_algorithm} but the draft was resolved for {aux.algorithm}; "
                "call resolve_spec_aux_hidden_state before configuring the pools"
            )
        budget_bytes = self.resolve_budget_bytes(budget)
        kv_dtype = configure_kv_cache_dtype(sa.kv_cache_dtype, mc, model_dtype=self.model_dtype)
        context_len = int(sa.context_length or mc.max_position_embeddings)
        inputs = ConfiguratorInputs(
            model_config=mc,
            kv_cache_dtype=kv_dtype,
            model_dtype=self.model_dtype,
            page_size=int(sa.page_size),
            context_len=context_len,
            spec_aux=aux,
            num_draft_tokens=self._num_draft_tokens(),
            max_running_requests=sa.max_running_requests,
            extra_req_slots=int(sa.disaggregation_decode_extra_slots) if sa.disaggregation_mode == "decode" else 0,
            draft_free_steps=self._draft_free_steps(),
            swa_full_tokens_ratio=self.swa_full_tokens_ratio,
            mamba_full_memory_ratio=self.mamba_full_memory_ratio,
        )
        conf = create_pool_configurator(inputs)
        plan = conf.solve(budget_bytes, sa.max_total_tokens)
        if plan.total_bytes() > budget_bytes:  # the solver guarantees this; a violation is a bug, not a state
            raise MemoryPlanError(f"plan {plan.total_bytes()} B exceeds budget {budget_bytes} B")
        if sa.max_total_tokens is not None and sa.max_total_tokens > plan.max_total_num_tokens:
            logger.warning(
                "--max-total-tokens %d exceeds what the budget holds; using %d",
                sa.max_total_tokens, plan.max_total_num_tokens,
            )
        ta = plan.target_attn
        cfg = MemoryPoolConfig(
            max_total_num_tokens=plan.max_total_num_tokens,
            max_running_requests=plan.max_running_requests,
            target_cell_bytes=conf.target_cell_bytes(),
            draft_cell_bytes=conf.draft_cell_bytes(),
            budget_bytes=budget_bytes,
            page_size=plan.page_size,
            context_len=context_len,
            req_to_token_context_len=plan.req_to_token_context_len,
            kv_cache_dtype=dtype_name(kv_dtype),
            attn_tp_size=conf.attn_tp_size,
            attn_dp_size=conf.attn_dp_size,
            configurator=conf.name,
            pool_plan=plan,
            swa_max_total_num_tokens=plan.swa_max_total_num_tokens,
            mamba_state_slots=plan.state_slots,
            state_bytes_per_slot=plan.target_state.bytes_per_slot() if plan.target_state else None,
            speculative_algorithm=aux.algorithm,
            draft_pricing=conf.draft_pricing,
            draft_kv_cache_dtype=dtype_name(aux.draft_kv_cache_dtype),
            target_kv_heads_per_rank=ta.head_num if ta is not None and ta.kind == "mha" else None,
            draft_kv_heads_per_rank=plan.draft.head_num if plan.draft is not None and plan.draft.kind == "mha" else None,
            max_total_tokens_flag=sa.max_total_tokens,
        )
        logger.info(
            "memory plan (%s): %d tokens x (%d target + %d draft) B/token, %d requests, %d / %d B",
            cfg.configurator, cfg.max_total_num_tokens, cfg.target_cell_bytes, cfg.draft_cell_bytes,
            cfg.max_running_requests, cfg.planned_total_bytes(), cfg.budget_bytes,
        )
        return cfg


# ====================================================================== building the pools


@dataclass
class KVPools:
    """The pools one runner uses; the draft's shares the target's allocator and request table."""

    token_to_kv_pool: Any
    req_to_token_pool: Optional[ReqToTokenPool] = None
    token_to_kv_pool_allocator: Any = None
    is_draft: bool = False
    # The draft's: rows of draft-free DFLASH steps waiting for their context K/V (None when none are planned).
    deferred_context: Optional[DeferredContextRows] = None

    def allocated_bytes(self) -> dict[str, int]:
        """Exact bytes per allocation, named as in ``MemoryPoolConfig.planned_pools()``."""
        if self.is_draft:
            out = {"draft_kv": self.token_to_kv_pool.nbytes()}
            if self.deferred_context is not None:
                out["draft_deferred_context"] = self.deferred_context.nbytes()
            return out
        pool = self.token_to_kv_pool
        out: dict[str, int] = {}
        if hasattr(pool, "full_to_swa_index_mapping"):
            parts = pool.part_nbytes()
            out.update(target_kv_full=parts["full"], target_kv_swa=parts["swa"],
                       target_full_to_swa_mapping=parts["mapping"])
        elif hasattr(pool, "state_pool"):
            parts = pool.part_nbytes()
            out.update(target_kv=parts["kv"], target_linear_state=parts["state"])
        else:
            out["target_kv"] = pool.nbytes()
        if self.req_to_token_pool is not None:
            out["req_to_token"] = self.req_to_token_pool.nbytes()
        return out


def _check_model_matches(cfg: MemoryPoolConfig, model_config: ModelConfig, is_draft: bool) -> None:
    plan = cfg.plan
    if is_draft:
        g = plan.draft
        if g is None:
            raise MemoryPlanError("the memory plan was made without a draft; cannot build a draft pool")
        if cfg.draft_pricing == "draft_geometry" and g.num_layers != model_config.num_hidden_layers:
            raise MemoryPlanError(
                f"the plan priced {g.num_layers} draft layers but the draft model has {model_config.num_hidden_layers}"
            )
        if g.kind == "mha" and (g.head_num, g.head_dim) != (
            model_config.get_num_kv_heads(cfg.attn_tp_size), model_config.head_dim
        ):
            raise MemoryPlanError("the draft model's KV geometry differs from the one the plan priced")
        return
    used = set(plan.target_attn.layer_ids)
    if plan.target_swa is not None:
        used |= set(plan.target_swa.layer_ids)
    if plan.target_state is not None:
        used |= set(plan.target_state.layer_ids)
    if used != set(range(model_config.num_hidden_layers)):
        raise MemoryPlanError("the memory plan's layers do not cover this model's layers; it was planned for another model")


def check_plan_matches_rank(memory_pool_config: MemoryPoolConfig) -> None:
    """A plan made elsewhere (the draft runner reuses the target's) must be built at this rank's live width."""
    live = int(get_parallel().attn_tp_size)
    if live != memory_pool_config.attn_tp_size:
        raise MemoryPlanError(
            f"pools planned at attn_tp_size={memory_pool_config.attn_tp_size} but this rank runs at {live}"
        )


def build_pools(
    memory_pool_config: MemoryPoolConfig,
    model_config: ModelConfig,
    *,
    device: str,
    is_draft: bool = False,
    target_pools: Optional[KVPools] = None,
    with_allocator: bool = True,
) -> KVPools:
    """Allocate the planned pools for the target (KV pool, request table, slot allocator) or the draft.

    The draft gets its own KV pool at the target's capacity and shares ``target_pools``' allocator and
    request table. ``with_allocator=False`` skips the allocator (``meta`` builds in ``sglite plan``).
    Everything it needs is in the plan (widths included): it reads no process-wide state.
    """
    _check_model_matches(memory_pool_config, model_config, is_draft)
    plan = memory_pool_config.plan
    if is_draft:
        return KVPools(
            token_to_kv_pool=plan.build_draft_kv_pool(device),
            req_to_token_pool=target_pools.req_to_token_pool if target_pools else None,
            token_to_kv_pool_allocator=target_pools.token_to_kv_pool_allocator if target_pools else None,
            is_draft=True,
            deferred_context=plan.build_draft_deferred_context(device),
        )
    kv = plan.build_target_kv_pool(device)
    allocator = None
    if with_allocator:
        if plan.layout == "hybrid_swa":
            allocator = SWATokenToKVPoolAllocator(
                plan.max_total_num_tokens, plan.swa_max_total_num_tokens, plan.page_size, device,
                kv.full_to_swa_index_mapping,
            )
        else:
            allocator = PagedTokenToKVPoolAllocator(plan.max_total_num_tokens, plan.page_size, device)
    return KVPools(
        token_to_kv_pool=kv,
        req_to_token_pool=plan.build_req_to_token_pool(device),
        token_to_kv_pool_allocator=allocator,
    )


@dataclass
class PlannedPools:
    """One rank's resolved draft price, its memory plan, and the pools built from that plan."""

    spec_aux_config: SpecAuxHiddenStateConfig
    memory_pool_config: MemoryPoolConfig
    target: KVPools
    draft: Optional[KVPools] = None

    def allocated_bytes(self) -> dict[str, int]:
        """Bytes each built pool allocated, named as in the plan."""
        out = dict(self.target.allocated_bytes())
        if self.draft is not None:
            out.update(self.draft.allocated_bytes())
        return out


def plan_and_build_pools(
    server_args: Any,
    model_config: ModelConfig,
    *,
    pool_device: str,
    model_dtype: Optional[torch.dtype] = None,
    spec_aux_config: Optional[SpecAuxHiddenStateConfig] = None,
    draft_model_config: Optional[ModelConfig] = None,
    build_draft: bool = False,
    with_allocator: bool = True,
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
    budget: KVBudgetInputs = KVBudgetInputs(),
) -> PlannedPools:
    """Resolve the draft's price, solve the plan, build the target's pools (and the draft's, ``build_draft``).

    The one orchestration of the target ``ModelRunner`` (real device; its draft runner builds the draft
    pool) and of `sglite plan` (``pool_device="meta"``, both pools). ``budget`` goes to ``configure``
    (CUDA profile, ``tp_group``); a given ``spec_aux_config`` skips the resolution (the planner needs it
    first to estimate the draft's weights).
    """
    model_dtype = model_dtype or resolve_model_dtype(server_args.dtype, model_config)
    aux = spec_aux_config or resolve_spec_aux_hidden_state(
        server_args, model_config, draft_model_config=draft_model_config, model_dtype=model_dtype
    )
    budget_device = None if pool_device == "meta" else pool_device  # meta: budget as the server would on its device
    cfg = KVCacheConfigurator(
        server_args, model_config, aux, model_dtype=model_dtype, device=budget_device,
        swa_full_tokens_ratio=swa_full_tokens_ratio,
    ).configure(budget)
    target = build_pools(cfg, model_config, device=pool_device, with_allocator=with_allocator)
    draft = None
    if build_draft and aux.has_draft:
        draft = build_pools(cfg, aux.draft_model_config, device=pool_device, is_draft=True, target_pools=target)
    return PlannedPools(aux, cfg, target, draft)
