"""`sglite plan`: the exact per-rank KV memory plan of a topology, simulated on this machine.

Every rank of the topology is simulated in this process: ``simulate_rank`` stamps that rank's live
widths into a scoped parallel bag, then the runtime's own code runs — the draft resolver
(``resolve_spec_aux_hidden_state``) and ``plan_and_build_pools``, the orchestration the target
``ModelRunner`` calls — with the pools built on torch's ``meta`` device, so their bytes are counted
without memory. No formula here is a second copy of the runtime's.

Budget per rank on CUDA (as at runtime): ``int(device_memory * mem_fraction_static) - weights``, with
the device memory taken as free before the weights load. Weights per rank are ``--weights-gb`` or the
estimate of ``estimate_weight_bytes_per_rank`` (formula in its docstring and docs/memory_plan.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from sglite.srt.configs.model_config import AttentionKind, ModelConfig, ModelConfigError
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.layers.hot_vocab_head import load_token_map
from sglite.srt.layers.moe.layer import check_moe_sharding
from sglite.srt.managers.base_model_worker import build_rank_report, format_rank_report
from sglite.srt.mem_cache.kv_cache_dtype import model_runtime_dtype
from sglite.srt.mem_cache.pool_plan import MemoryPlanError, MemoryPoolConfig
from sglite.srt.model_executor.kv_cache_configurator import (
    GiB,
    KVBudgetInputs,
    plan_and_build_pools,
    resolve_model_dtype,
)
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
    DraftResolutionError,
    load_draft_model_config,
    resolve_spec_aux_hidden_state,
)
from sglite.srt.model_executor.pool_configurator import DEFAULT_SWA_FULL_TOKENS_RATIO
from sglite.srt.runtime_context import ParallelState, check_attn_cp_supported, scoped
from sglite.srt.server_args import (
    DRAFT_MODEL_QUANTIZATIONS,
    KV_CACHE_DTYPES,
    SPECULATIVE_ALGORITHMS,
    ServerArgs,
    ServerArgsError,
)

# ====================================================================== weights estimate


def _weight_elem_bytes(mc: ModelConfig, dtype: Optional[torch.dtype] = None) -> tuple[float, float]:
    """(bytes per dense linear weight, bytes per expert weight): the runtime ``dtype`` (default: the
    checkpoint's), except where the checkpoint is quantized."""
    dtype_bytes = float((dtype or model_runtime_dtype("auto", mc)).itemsize)
    quant = (mc.hf_config.get("quantization_config") or {}).get("quant_method")
    if quant == "fp8":
        return 1.0, 1.0
    if quant == "mxfp4":  # gpt-oss: only the experts are MXFP4 (4 bits + one 8-bit scale per 32)
        return dtype_bytes, 4.25 / 8
    return dtype_bytes, dtype_bytes


def _attn_params_per_rank(mc: ModelConfig, kind: AttentionKind, attn_tp: int) -> float:
    h, text = mc.hidden_size, (mc.hf_config.get("text_config") or mc.hf_config)
    heads = mc.num_attention_heads / attn_tp
    if kind == AttentionKind.MLA:
        nope_rope = mc.head_dim  # qk_nope + qk_rope
        q_lora = text.get("q_lora_rank")
        q = h * q_lora + q_lora * heads * nope_rope if q_lora else h * heads * nope_rope
        kv_a = h * (mc.kv_lora_rank + mc.qk_rope_head_dim)  # replicated on every rank
        nope = mc.head_dim - mc.qk_rope_head_dim
        kv_b = mc.kv_lora_rank * heads * (nope + mc.v_head_dim)
        return q + kv_a + kv_b + heads * mc.v_head_dim * h
    if kind == AttentionKind.LINEAR:
        ls = mc.linear_state
        sh = ls.num_heads / attn_tp
        return h * sh * (2 * ls.state_k_dim + 2 * ls.state_v_dim) + sh * ls.state_v_dim * h
    kv = mc.get_num_kv_heads(attn_tp) if kind == AttentionKind.FULL else mc.get_swa_num_kv_heads(attn_tp)
    return h * heads * mc.head_dim * 2 + h * kv * (mc.head_dim + mc.v_head_dim)


def _mlp_params(mc: ModelConfig, layer: int) -> tuple[float, float, float]:
    """(dense params split over TP, expert params, replicated router params) of one layer's MLP, whole model."""
    h, moe = mc.hidden_size, mc.moe
    if moe is None or not moe.is_sparse_layer(layer):
        return 3.0 * h * mc.intermediate_size, 0.0, 0.0
    shared = 3.0 * h * moe.moe_intermediate_size * moe.num_shared_experts
    shared += 3.0 * h * moe.shared_expert_intermediate_size
    return shared, 3.0 * h * moe.moe_intermediate_size * moe.num_experts, float(h * moe.num_experts)


def estimate_weight_bytes_per_rank(
    mc: ModelConfig, tp_size: int, attn_tp_size: int, *, with_embeddings: bool = True, dtype: Optional[torch.dtype] = None
) -> int:
    """Weights one rank holds, estimated from the config.

    ``sum_layers(attn(attn_tp) * dense_b + (mlp_dense * dense_b + experts * expert_b) / tp)
    + embed * dense_b / attn_tp + lm_head * dense_b / tp`` where ``attn`` is the per-rank attention
    projection count (q/o and KV heads split over attention TP, KV heads replicated past their count,
    MLA's kv_a replicated), MLPs and experts split over the whole TP group, the embedding
    vocab-parallel over attention TP and the LM head over TP (one shared tensor when tied and the
    widths agree); bytes per weight from the runtime ``dtype`` (default: the checkpoint's; fp8 checkpoints
    1 B; MXFP4 experts 4.25 bits).
    MoE routers are held whole on every rank (fp32 where the family keeps them so). Norms and biases are
    left out (< 0.1 %).
    """
    dense_b, expert_b = _weight_elem_bytes(mc, dtype)
    total = 0.0
    for i, kind in enumerate(mc.layer_kinds):
        total += _attn_params_per_rank(mc, kind, attn_tp_size) * dense_b
        dense, expert, router = _mlp_params(mc, i)
        # Experts split over TP whatever --ep-size: E/ep experts of width I/(tp/ep) is E*I/tp per rank.
        total += (dense * dense_b + expert * expert_b) / tp_size
        total += router * (4.0 if mc.moe is not None and mc.moe.router_fp32 else dense_b)  # on every rank
    if with_embeddings:
        # The embedding is split over attention TP, the LM head over all of TP (DP attention's split);
        # a tied pair shares one tensor only when those widths agree.
        emb = mc.vocab_size * mc.hidden_size
        total += emb * dense_b / attn_tp_size
        if not (mc.tie_word_embeddings and attn_tp_size == tp_size):
            total += emb * dense_b / tp_size
    return int(total)


def _block_draft_head_params(draft: ModelConfig, hot_vocab_size: int = 0) -> int:
    """Replicated parameters a DFLASH/DSPARK draft adds to its layers: ``fc`` and DSPARK's heads.

    fc ``K*H*H``; Markov ``markov_w1`` ``V*r`` + ``markov_w2`` ``V*r`` (``hot_vocab_size*r`` under a token map,
    which keeps only the map's rows), plus the gated head's ``gate_proj`` ``(H+r)*r + r`` or the rnn head's
    ``joint_proj`` ``(2r+H)*3r + 3r``; confidence ``proj`` ``in + 1``.
    """
    spec, h, v = draft.draft, draft.hidden_size, draft.vocab_size
    total = len(spec.target_layer_ids) * h * h
    if spec.algorithm == "DSPARK":
        r = spec.markov_rank
        total += v * r + (hot_vocab_size or v) * r
        if spec.markov_head_type == "gated":
            total += (h + r) * r + r
        elif spec.markov_head_type == "rnn":
            total += (2 * r + h) * 3 * r + 3 * r
        if spec.enable_confidence_head:
            total += h + (r if spec.confidence_head_with_markov else 0) + 1
    return total


def estimate_draft_weight_bytes_per_rank(
    draft: ModelConfig, algorithm: str, tp_size: int, attn_tp_size: int, *, dtype: Optional[torch.dtype] = None,
    hot_vocab_size: int = 0,
) -> int:
    """Draft weights on one rank, in the runtime ``dtype`` (a draft runs in its target's under --dtype auto).

    DFLASH/DSPARK: its layers plus ``fc`` and DSPARK's Markov / confidence heads (replicated); the
    embedding and LM head are the target's (a checkpoint's copies are dropped at load, as speculators
    and SGLang do), so they are not counted twice; a --speculative-token-map of ``hot_vocab_size`` ids
    adds its replicated head rows ``hot_vocab_size * H`` (and cuts DSPARK's ``markov_w2`` to its rows).
    EAGLE/STANDALONE are whole small models.
    """
    if algorithm in ("DFLASH", "DSPARK"):
        dense_b, _ = _weight_elem_bytes(draft, dtype)
        layers = estimate_weight_bytes_per_rank(draft, tp_size, attn_tp_size, with_embeddings=False, dtype=dtype)
        replicated = _block_draft_head_params(draft, hot_vocab_size) + hot_vocab_size * draft.hidden_size
        return layers + int(replicated * dense_b)
    return estimate_weight_bytes_per_rank(draft, tp_size, attn_tp_size, with_embeddings=True, dtype=dtype)


# ====================================================================== simulation


@dataclass
class PoolReport:
    """One allocation: planned bytes from the plan, allocated bytes of the meta tensors."""

    name: str
    planned_bytes: int
    allocated_bytes: int


@dataclass
class RankReport:
    """One simulated rank's plan (the JSON schema of `sglite plan --json`, plus a few extras)."""

    rank: int
    attn_tp_size: int
    attn_dp_size: int
    attn_cp_size: int
    target_kv_heads_per_rank: Optional[int]
    draft_kv_heads_per_rank: Optional[int]
    target_cell_bytes: int
    draft_cell_bytes: Optional[int]
    max_total_num_tokens: int
    budget_bytes: int
    pools: list[PoolReport]
    # extras
    max_running_requests: int = 0
    weights_bytes: Optional[int] = None
    configurator: str = ""
    swa_max_total_num_tokens: Optional[int] = None
    mamba_state_slots: Optional[int] = None
    planned_total_bytes: int = 0
    memory_pool_config: Optional[MemoryPoolConfig] = field(default=None, repr=False)
    # The report a serving rank sends (BaseModelWorker.rank_report): the same builder, the same line.
    rank_report: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this rank."""
        return {
            "rank": self.rank,
            "attn_tp_size": self.attn_tp_size,
            "attn_dp_size": self.attn_dp_size,
            "attn_cp_size": self.attn_cp_size,
            "target_kv_heads_per_rank": self.target_kv_heads_per_rank,
            "draft_kv_heads_per_rank": self.draft_kv_heads_per_rank,
            "target_cell_bytes": self.target_cell_bytes,
            "draft_cell_bytes": self.draft_cell_bytes,
            "max_total_num_tokens": self.max_total_num_tokens,
            "budget_bytes": self.budget_bytes,
            "pools": [
                {"name": p.name, "planned_bytes": p.planned_bytes, "allocated_bytes": p.allocated_bytes}
                for p in self.pools
            ],
            "max_running_requests": self.max_running_requests,
            "weights_bytes": self.weights_bytes,
            "configurator": self.configurator,
            "swa_max_total_num_tokens": self.swa_max_total_num_tokens,
            "mamba_state_slots": self.mamba_state_slots,
            "planned_total_bytes": self.planned_total_bytes,
            "rank_report": self.rank_report,
        }


def plan_rank(
    server_args: ServerArgs,
    model_config: ModelConfig,
    rank: int,
    *,
    draft_model_config: Optional[ModelConfig] = None,
    device_memory_bytes: Optional[int] = None,
    weights_bytes: Optional[int] = None,
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
    hot_vocab_size: int = 0,
) -> RankReport:
    """Simulate one rank with the runtime's code and build its pools on ``meta``.

    ``hot_vocab_size``: the ids of --speculative-token-map (plan_topology loads and checks the map once).
    """
    sa = server_args
    par = ParallelState(sa.tp_size, sa.dp_size, sa.enable_dp_attention, sa.attn_cp_size, sa.pp_size, sa.ep_size)
    model_dtype = resolve_model_dtype(sa.dtype, model_config)
    if sa.speculative_algorithm is not None:
        check_attn_cp_supported(par.attn_cp_size)  # the runtime's own refusal (its layers call it)
    with scoped(parallel=par):
        simulate_rank(par, rank)
        aux = resolve_spec_aux_hidden_state(sa, model_config, draft_model_config=draft_model_config, model_dtype=model_dtype)
        device = sa.resolved_device()
        if device == "cuda":
            if device_memory_bytes is None:
                raise MemoryPlanError("planning a CUDA topology needs --device-memory-gb")
            if weights_bytes is None:
                weights_bytes = estimate_weight_bytes_per_rank(model_config, sa.tp_size, par.attn_tp_size, dtype=model_dtype)
                if aux.has_draft:
                    weights_bytes += estimate_draft_weight_bytes_per_rank(
                        aux.draft_model_config, aux.algorithm, sa.tp_size, par.attn_tp_size, dtype=model_dtype,
                        hot_vocab_size=hot_vocab_size,
                    )
        budget = KVBudgetInputs()
        if device == "cuda":
            budget = KVBudgetInputs(pre_model_load_free_bytes=device_memory_bytes, weights_bytes=weights_bytes)
        planned = plan_and_build_pools(
            sa, model_config, pool_device="meta", model_dtype=model_dtype, spec_aux_config=aux, build_draft=True,
            with_allocator=False, swa_full_tokens_ratio=swa_full_tokens_ratio, budget=budget,
        )
        cfg, allocated = planned.memory_pool_config, planned.allocated_bytes()
        pools = [PoolReport(p.name, p.planned_bytes, allocated.get(p.name, -1)) for p in cfg.planned_pools()]
        extra = set(allocated) - {p.name for p in pools}
        if extra:
            raise MemoryPlanError(f"pools allocated but not planned: {sorted(extra)}")
        return RankReport(
            rank=rank,
            attn_tp_size=par.attn_tp_size,
            attn_dp_size=par.attn_dp_size,
            attn_cp_size=par.attn_cp_size,
            target_kv_heads_per_rank=cfg.target_kv_heads_per_rank,
            draft_kv_heads_per_rank=cfg.draft_kv_heads_per_rank if aux.has_draft else None,
            target_cell_bytes=cfg.target_cell_bytes,
            draft_cell_bytes=cfg.draft_cell_bytes if aux.has_draft else None,
            max_total_num_tokens=cfg.max_total_num_tokens,
            budget_bytes=cfg.budget_bytes,
            pools=pools,
            max_running_requests=cfg.max_running_requests,
            weights_bytes=weights_bytes,
            configurator=cfg.configurator,
            swa_max_total_num_tokens=cfg.swa_max_total_num_tokens,
            mamba_state_slots=cfg.mamba_state_slots,
            planned_total_bytes=cfg.planned_total_bytes(),
            memory_pool_config=cfg,
            rank_report=build_rank_report(dataclasses.asdict(cfg), par, allocated),
        )


def plan_topology(
    server_args: ServerArgs,
    *,
    model_config: Optional[ModelConfig] = None,
    draft_model_config: Optional[ModelConfig] = None,
    device_memory_bytes: Optional[int] = None,
    weights_bytes: Optional[int] = None,
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
) -> list[RankReport]:
    """Plan every rank (0 .. tp_size-1) of the topology."""
    mc = model_config or ModelConfig.from_path(server_args.model_path)
    if mc.moe is not None:  # the MoE layers' own refusal of a split that does not divide
        check_moe_sharding(mc.moe.num_experts, mc.moe.moe_intermediate_size, server_args.tp_size, server_args.ep_size)
    if draft_model_config is None and server_args.speculative_algorithm is not None:
        draft_model_config = load_draft_model_config(server_args)
    # The draft runner's own check of the map: a bad file is refused here as at start-up.
    token_map = server_args.speculative_token_map
    hot_vocab_size = load_token_map(token_map, mc.vocab_size).numel() if token_map else 0
    return [
        plan_rank(
            server_args, mc, r, draft_model_config=draft_model_config, device_memory_bytes=device_memory_bytes,
            weights_bytes=weights_bytes, swa_full_tokens_ratio=swa_full_tokens_ratio, hot_vocab_size=hot_vocab_size,
        )
        for r in range(server_args.tp_size)
    ]


# ====================================================================== CLI

# The planner's defaults are the server's, so a plan without flags is the plan `sglite serve` makes.
_SERVER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerArgs)}


def build_parser() -> argparse.ArgumentParser:
    """Flags of `sglite plan` (server flags keep their SGLang names)."""
    p = argparse.ArgumentParser(prog="sglite plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="Model directory or a config.json file")
    p.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS)
    p.add_argument("--speculative-draft-model-path", help="Draft model directory or config.json")
    p.add_argument("--speculative-draft-kv-cache-dtype", choices=KV_CACHE_DTYPES)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-dspark-block-size", type=int)
    p.add_argument("--speculative-disable-by-batch-size", type=int,
                   help="DFLASH/DSPARK: batches this large skip the draft (plans the deferred draft context buffer)")
    p.add_argument("--speculative-token-map", default=None,
                   help="hot token ids of the draft head (.pt); their replicated rows count as draft weights")
    p.add_argument("--speculative-draft-model-quantization", choices=DRAFT_MODEL_QUANTIZATIONS,
                   help="DFLASH/DSPARK on CPU: q8_0 draft weights (no KV bytes change; checked as the server checks it)")
    p.add_argument("--speculative-adaptive", action="store_true", default=None,
                   help="DFLASH/DSPARK: draft only while it pays (plans the deferred draft context buffer)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--attn-cp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1,
                   help="MoE expert-parallel size within the TP group (per-rank expert weights are E*I/tp either way)")
    p.add_argument("--mem-fraction-static", type=float, default=_SERVER_DEFAULTS["mem_fraction_static"])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="Device to plan for (cpu uses --cpu-kv-cache-budget-mb)")
    p.add_argument("--device-memory-gb", type=float, help="Memory per device in GiB, free before weights load")
    p.add_argument("--cpu-kv-cache-budget-mb", type=int, default=_SERVER_DEFAULTS["cpu_kv_cache_budget_mb"])
    p.add_argument("--weights-gb", type=float, help="Weights per rank in GiB (default: estimated from the config)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--context-length", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--swa-full-tokens-ratio", type=float, default=DEFAULT_SWA_FULL_TOKENS_RATIO)
    p.add_argument("--json", action="store_true", help="Print the plan as JSON")
    return p


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def format_table(reports: list[RankReport], header: str) -> str:
    """A readable per-rank table plus rank 0's pools."""
    cols = ["rank", "attn tp/dp/cp", "kv heads t/d", "cell B t+d", "max tokens", "max reqs",
            "weights GiB", "budget GiB", "planned GiB", "use %"]
    rows = []
    for r in reports:
        heads = f"{r.target_kv_heads_per_rank if r.target_kv_heads_per_rank is not None else 'mla'}"
        heads += f"/{r.draft_kv_heads_per_rank if r.draft_kv_heads_per_rank is not None else '-'}"
        cell = f"{r.target_cell_bytes}+{r.draft_cell_bytes if r.draft_cell_bytes is not None else 0}"
        rows.append([
            str(r.rank), f"{r.attn_tp_size}/{r.attn_dp_size}/{r.attn_cp_size}", heads, cell,
            str(r.max_total_num_tokens), str(r.max_running_requests), _gib(r.weights_bytes),
            _gib(r.budget_bytes), _gib(r.planned_total_bytes), f"{100 * r.planned_total_bytes / r.budget_bytes:.3f}",
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    out = [header, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    r0 = reports[0]
    out.append("")
    extra = []
    if r0.swa_max_total_num_tokens is not None:
        extra.append(f"sliding-window pool {r0.swa_max_total_num_tokens} tokens")
    if r0.mamba_state_slots is not None:
        extra.append(f"recurrent state slots {r0.mamba_state_slots}")
    out.append(f"rank 0 pools ({r0.configurator}{'; ' + '; '.join(extra) if extra else ''}):")
    name_w = max(len(p.name) for p in r0.pools)
    out.append(f"  {'pool'.ljust(name_w)}  {'planned B':>16}  {'allocated B (meta)':>18}  equal")
    for p in r0.pools:
        out.append(f"  {p.name.ljust(name_w)}  {p.planned_bytes:>16}  {p.allocated_bytes:>18}  "
                   f"{'yes' if p.planned_bytes == p.allocated_bytes else 'NO'}")
    out.append("")
    out.append("per-rank reports (the line each serving rank logs at start-up):")
    out += [f"  {format_rank_report(r.rank_report)}" for r in reports]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `sglite plan`."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        sa = ServerArgs(
            model_path=a.model_path,
            speculative_algorithm=a.speculative_algorithm,
            speculative_draft_model_path=a.speculative_draft_model_path,
            speculative_draft_kv_cache_dtype=a.speculative_draft_kv_cache_dtype,
            speculative_num_draft_tokens=a.speculative_num_draft_tokens,
            speculative_dspark_block_size=a.speculative_dspark_block_size,
            speculative_disable_by_batch_size=a.speculative_disable_by_batch_size,
            speculative_adaptive=a.speculative_adaptive,
            speculative_draft_model_quantization=a.speculative_draft_model_quantization,
            speculative_token_map=a.speculative_token_map,
            tp_size=a.tp_size, dp_size=a.dp_size, enable_dp_attention=a.enable_dp_attention,
            attn_cp_size=a.attn_cp_size, ep_size=a.ep_size, mem_fraction_static=a.mem_fraction_static, device=a.device,
            cpu_kv_cache_budget_mb=a.cpu_kv_cache_budget_mb, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
            page_size=a.page_size, context_length=a.context_length, max_total_tokens=a.max_total_tokens,
            max_running_requests=a.max_running_requests,
        ).validate()
    except ServerArgsError as e:
        parser.error(str(e))
    if a.device == "cuda" and a.device_memory_gb is None:
        parser.error("--device-memory-gb is required when planning a CUDA topology (or pass --device cpu)")
    try:
        reports = plan_topology(
            sa,
            device_memory_bytes=int(a.device_memory_gb * GiB) if a.device_memory_gb is not None else None,
            weights_bytes=int(a.weights_gb * GiB) if a.weights_gb is not None else None,
            swa_full_tokens_ratio=a.swa_full_tokens_ratio,
        )
    except (ModelConfigError, DraftResolutionError, MemoryPlanError, ValueError) as e:
        print(f"sglite plan: error: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"ranks": [r.to_json() for r in reports]}, indent=2))
    else:
        draft = f" + {sa.speculative_algorithm} draft" if sa.speculative_algorithm else ""
        header = (
            f"sglite plan: {a.model_path}{draft}; tp {sa.tp_size} dp {sa.dp_size}"
            f"{' (DP attention)' if sa.enable_dp_attention else ''} cp {sa.attn_cp_size}"
            f"{f' ep {sa.ep_size}' if sa.ep_size > 1 else ''}; "
            + (f"{a.device_memory_gb} GiB x {sa.mem_fraction_static}" if a.device == "cuda"
               else f"cpu budget {sa.cpu_kv_cache_budget_mb} MiB")
            + f"; kv {sa.kv_cache_dtype}; page {sa.page_size}"
        )
        print(format_table(reports, header))
    mismatched = [(r.rank, p.name) for r in reports for p in r.pools if p.planned_bytes != p.allocated_bytes]
    if mismatched:
        print(f"sglite plan: planned != allocated for {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
