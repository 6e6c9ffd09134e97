"""Resolve what the target must capture for a draft and what the draft's KV costs per token per rank.

``resolve_spec_aux_hidden_state`` runs in the target ``ModelRunner`` after ``init_parallel_runtime``:
it prices the draft at ``get_parallel().attn_tp_size``, the live width the pool builders use. Reading
it earlier raises ``ParallelNotInitializedError``, which propagates with a note saying where it was
read: there is no fallback to ``tp_size`` (under DP attention that under-counts the draft's heads) and
no fallback to zero. A draft that cannot be resolved raises ``DraftResolutionError`` naming what is
missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglite.srt.configs.model_config import AttentionKind, ModelConfig, ModelConfigError, draft_tokens_per_block
from sglite.srt.mem_cache.kv_cache_dtype import KVCacheDtypeError, configure_kv_cache_dtype
from sglite.srt.mem_cache.pool_plan import AttnPoolGeometry, attn_pool_geometry
from sglite.srt.runtime_context import ParallelNotInitializedError, get_parallel
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm


class DraftResolutionError(ValueError):
    """The draft's capture layers, layer count, geometry or KV dtype cannot be resolved."""


@dataclass(frozen=True)
class SpecAuxHiddenStateConfig:
    """What the target captures for its draft, and the draft's per-rank KV geometry and price."""

    algorithm: Optional[str] = None
    # DFLASH/DSPARK: target layers whose output hidden states feed the draft (DFlash convention).
    target_layer_ids: tuple[int, ...] = ()
    draft_num_layers: int = 0
    # The draft pool's per-rank geometry: its ``cell_bytes()`` is the draft's KV price, for the resolver,
    # the configurators, the planner and the pool builder alike.
    draft_geometry: Optional[AttnPoolGeometry] = None
    draft_kv_cache_dtype: Optional[torch.dtype] = None
    draft_total_kv_heads: Optional[int] = None
    draft_kv_heads_per_rank: Optional[int] = None
    draft_head_dim: Optional[int] = None
    draft_v_head_dim: Optional[int] = None
    attn_tp_size: Optional[int] = None  # the width the draft was priced at
    # The one resolution of the block (``resolve_block_geometry``): the draft forward's width B and the
    # drafts one verify proposes (DSPARK with sample_from_anchor: B; DFLASH: B-1; EAGLE: steps).
    draft_block_size: int = 0
    num_proposed_drafts: int = 0
    draft_model_config: Optional[ModelConfig] = field(default=None, repr=False, compare=False)

    @property
    def has_draft(self) -> bool:
        """Whether a speculative draft (and so a draft KV pool) exists."""
        return self.algorithm is not None

    @property
    def is_dflash_family(self) -> bool:
        """DFLASH and DSPARK: exact draft term from the draft's own geometry."""
        return SpeculativeAlgorithm.from_string(self.algorithm).is_dflash_family()

    @property
    def draft_cell_bytes(self) -> Optional[int]:
        """Draft KV bytes per token per rank: the draft pool geometry's ``cell_bytes()`` (None without a draft)."""
        return self.draft_geometry.cell_bytes() if self.draft_geometry is not None else None

    @property
    def num_verify_tokens(self) -> int:
        """Tokens the target verifies per request per decode step (the anchor + the drafts); 0 without a draft."""
        return self.num_proposed_drafts + 1 if self.has_draft else 0


def _fail(algorithm: str, where: str, what: str) -> DraftResolutionError:
    return DraftResolutionError(f"cannot resolve the {algorithm} draft ({where}): {what}")


def load_draft_model_config(server_args: Any) -> ModelConfig:
    """Read the draft's config.json from ``--speculative-draft-model-path``."""
    algo = server_args.speculative_algorithm
    path = server_args.speculative_draft_model_path
    if path is None:
        raise DraftResolutionError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    try:
        return ModelConfig.from_path(path)
    except ModelConfigError as e:
        raise _fail(algo, path, f"{e}; fix the draft's config.json") from e


def _resolve_dflash_aux_hidden_state(
    algorithm: str, draft_model_config: ModelConfig, target_model_config: ModelConfig
) -> tuple[list[int], int]:
    """(target layer ids to capture, draft layer count) of a DFLASH/DSPARK draft, validated against the target."""
    where = draft_model_config.path or "draft config"
    spec = draft_model_config.draft
    if spec is None:
        raise DraftResolutionError(
            f"{where} is not a DFLASH/DSPARK draft: config.json has no dflash_config, DFlash/DSpark "
            "architecture or markov_rank; point --speculative-draft-model-path at a block-diffusion draft"
        )
    algo = spec.algorithm
    if algo != algorithm:
        raise DraftResolutionError(
            f"--speculative-algorithm {algorithm} but the draft checkpoint {where} is a {algo} draft "
            f"(architectures {draft_model_config.architectures})"
        )
    num_layers = int(draft_model_config.num_hidden_layers)
    if num_layers <= 0:
        raise _fail(algo, where, f"num_hidden_layers is {num_layers}; a draft needs at least one layer")
    bad = [k.value for k in draft_model_config.layer_kinds if k != AttentionKind.FULL]
    if bad:
        raise _fail(algo, where, f"draft layers must be full attention, found {sorted(set(bad))}")
    n_target = target_model_config.num_hidden_layers
    if spec.num_target_layers is not None and spec.num_target_layers != n_target:
        raise _fail(
            algo, where,
            f"num_target_layers is {spec.num_target_layers} but the target has {n_target} layers; "
            "this draft was trained for another target",
        )
    ids = list(spec.target_layer_ids)
    if not ids:
        raise _fail(algo, where, "target_layer_ids is empty")
    out_of_range = [i for i in ids if not 0 <= i < n_target]
    if out_of_range:
        raise _fail(algo, where, f"target_layer_ids {out_of_range} are outside the target's {n_target} layers")
    return ids, num_layers


def resolve_block_geometry(server_args: Any, draft_model_config: ModelConfig) -> tuple[int, int]:
    """(B, drafts per verify) of a DFLASH/DSPARK draft: the one place the block size is resolved.

    ``--speculative-num-draft-tokens`` is the verify width as in SGLang (DFLASH: B; DSPARK with
    ``sample_from_anchor``: B+1); ``--speculative-dspark-block-size`` sets a DSPARK block directly;
    otherwise the checkpoint's ``block_size``. Flags that disagree are an error naming both.
    """
    spec = draft_model_config.draft
    anchor = bool(spec.sample_from_anchor)
    verify = server_args.speculative_num_draft_tokens
    dspark_block = getattr(server_args, "speculative_dspark_block_size", None)
    if dspark_block is not None and spec.algorithm != "DSPARK":
        raise _fail(spec.algorithm, draft_model_config.path or "draft config",
                    "--speculative-dspark-block-size is only for DSPARK drafts; use --speculative-num-draft-tokens")
    if dspark_block is not None:
        block = int(dspark_block)
    elif verify is not None:
        block = int(verify) - 1 if anchor else int(verify)
    else:
        block = int(spec.block_size)
    drafts = draft_tokens_per_block(block, anchor)
    if verify is not None and int(verify) != drafts + 1:
        raise _fail(
            spec.algorithm, draft_model_config.path or "draft config",
            f"--speculative-num-draft-tokens {verify} disagrees with block size {block}, which verifies {drafts + 1} tokens",
        )
    if block < 1 or drafts < 1:
        raise _fail(
            spec.algorithm, draft_model_config.path or "draft config",
            f"block size {block} proposes {drafts} drafts; a {spec.algorithm} block must propose at least one "
            "(raise --speculative-num-draft-tokens)",
        )
    return block, drafts


def _live_attn_tp_size() -> int:
    try:
        return int(get_parallel().attn_tp_size)
    except ParallelNotInitializedError as e:
        raise ParallelNotInitializedError(
            f"{e} -- resolve_spec_aux_hidden_state prices the draft KV at the live attention-TP width, "
            "so it must run after init_parallel_runtime()"
        ) from e


def _resolve_draft_dtype(server_args: Any, draft_model_config: ModelConfig, model_dtype: Optional[torch.dtype]) -> torch.dtype:
    try:
        return configure_kv_cache_dtype(
            server_args.kv_cache_dtype,
            draft_model_config,
            is_draft=True,
            draft_override=server_args.speculative_draft_kv_cache_dtype,
            model_dtype=model_dtype,
        )
    except KVCacheDtypeError as e:
        raise _fail(server_args.speculative_algorithm, draft_model_config.path or "draft config", str(e)) from e


def eagle_draft_num_layers(draft_model_config: ModelConfig) -> int:
    """Draft layers of an EAGLE/STANDALONE draft: num_nextn_predict_layers if set, else num_hidden_layers."""
    nextn = draft_model_config.hf_config.get("num_nextn_predict_layers")
    return int(nextn) if nextn else int(draft_model_config.num_hidden_layers)


def _check_shares_target_geometry(draft: ModelConfig, target: ModelConfig, algo: str) -> None:
    # The layer-ratio price is exact only when a draft layer costs what a target attention layer costs.
    fields = ("num_key_value_heads", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim")
    diff = {f: (getattr(draft, f), getattr(target, f)) for f in fields if getattr(draft, f) != getattr(target, f)}
    target_attn = AttentionKind.MLA if target.kv_lora_rank is not None else AttentionKind.FULL
    if any(k != target_attn for k in draft.layer_kinds):
        diff["layer kinds"] = (sorted({k.value for k in draft.layer_kinds}), target_attn.value)
    if diff:
        raise _fail(
            algo, draft.path or "draft config",
            f"an {algo} draft is priced by the target's per-layer KV geometry (layer ratio), but it differs "
            f"(draft, target): {diff}; use a draft that shares the target's attention geometry",
        )


def _draft_kv_fields(draft: ModelConfig, n_layers: int, dtype: torch.dtype, attn_tp_size: int) -> dict[str, Any]:
    """The draft-pool geometry fields of SpecAuxHiddenStateConfig every draft algorithm fills the same way."""
    geometry = attn_pool_geometry(draft, range(n_layers), dtype, attn_tp_size, mla=draft.kv_lora_rank is not None)
    return dict(
        draft_geometry=geometry,
        draft_kv_cache_dtype=dtype,
        draft_total_kv_heads=draft.num_key_value_heads,
        draft_kv_heads_per_rank=draft.get_num_kv_heads(attn_tp_size),
        draft_head_dim=draft.head_dim,
        draft_v_head_dim=draft.v_head_dim,
        attn_tp_size=attn_tp_size,
        draft_model_config=draft,
    )


def resolve_spec_aux_hidden_state(
    server_args: Any,
    target_model_config: ModelConfig,
    *,
    draft_model_config: Optional[ModelConfig] = None,
    model_dtype: Optional[torch.dtype] = None,
) -> SpecAuxHiddenStateConfig:
    """Resolve capture layers and the draft's per-rank KV price; empty config when speculation is off.

    ``draft_model_config`` defaults to the config.json at ``--speculative-draft-model-path``;
    ``model_dtype`` is the runtime dtype (it resolves a KV dtype of ``auto``).
    """
    algo = server_args.speculative_algorithm
    try:
        spec = SpeculativeAlgorithm.from_string(algo)
    except ValueError as e:
        raise DraftResolutionError(str(e)) from None
    if spec.is_none():
        return SpecAuxHiddenStateConfig()
    draft = draft_model_config if draft_model_config is not None else load_draft_model_config(server_args)
    attn_tp_size = _live_attn_tp_size()
    dtype = _resolve_draft_dtype(server_args, draft, model_dtype)
    if spec.is_dflash_family():
        ids, n_layers = _resolve_dflash_aux_hidden_state(algo, draft, target_model_config)
        block, n_drafts = resolve_block_geometry(server_args, draft)
        return SpecAuxHiddenStateConfig(
            algorithm=algo,
            target_layer_ids=tuple(ids),
            draft_num_layers=n_layers,
            draft_block_size=block,
            num_proposed_drafts=n_drafts,
            **_draft_kv_fields(draft, n_layers, dtype, attn_tp_size),
        )
    # EAGLE/STANDALONE: priced by the target's per-layer geometry (the layer ratio).
    _check_shares_target_geometry(draft, target_model_config, algo)
    n_layers = eagle_draft_num_layers(draft)
    if n_layers <= 0:
        raise _fail(algo, draft.path or "draft config", "the draft has no layers")
    return SpecAuxHiddenStateConfig(
        algorithm=algo,
        draft_num_layers=n_layers,
        num_proposed_drafts=int(server_args.speculative_num_draft_tokens or (server_args.speculative_num_steps or 1) + 1) - 1,
        **_draft_kv_fields(draft, n_layers, dtype, attn_tp_size),
    )
