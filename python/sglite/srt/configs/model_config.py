"""ModelConfig: the attention geometry and draft settings read from a HF config.json.

Accepts transformers 4.x and 5.x spellings (``rope_theta`` / ``rope_parameters``, ``torch_dtype`` /
``dtype``, a nested ``text_config``). Every layer gets an ``AttentionKind``; the memory planner
prices layers from these kinds only, so a config the planner cannot price fails here, loudly.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


class ModelConfigError(ValueError):
    """A config.json that cannot be resolved; the message says which field is missing or wrong."""


class AttentionKind(str, enum.Enum):
    FULL = "full"  # MHA / GQA over the whole context
    SLIDING = "sliding"  # MHA / GQA within a sliding window
    MLA = "mla"  # multi-head latent attention: one latent (kv_lora_rank + rope) vector per token
    LINEAR = "linear"  # recurrent / linear attention: per-request state, no per-token KV


# Architectures of block-diffusion drafts: they have no embedding or lm_head of their own.
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default capture rule: [L//2] for one draft layer, else ids spread evenly over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class LinearStateGeometry:
    """Per-layer recurrent state of a linear-attention layer, in elements (before TP sharding)."""

    num_heads: int  # heads that carry a state matrix (sharded by attn TP)
    state_k_dim: int
    state_v_dim: int
    conv_channels: int  # short-convolution channels (sharded by attn TP)
    conv_kernel: int

    def state_elems_per_rank(self, attn_tp_size: int) -> int:
        """Elements of one request's recurrent + conv state on one rank, for one layer."""
        heads = max(1, self.num_heads // attn_tp_size)
        conv = max(1, self.conv_channels // attn_tp_size) * (self.conv_kernel - 1)
        return heads * self.state_k_dim * self.state_v_dim + conv


@dataclass(frozen=True)
class MoEGeometry:
    """Routed-expert layout of an MoE model, under the names of every served family's config.json.

    Experts: ``num_experts`` (Qwen3-MoE), ``num_local_experts`` (transformers 5's spelling, gpt-oss) or
    ``n_routed_experts`` (DeepSeek / Kimi). Which layers are sparse: not the first ``first_k_dense_replace``
    (DeepSeek), not in ``mlp_only_layers``, and every ``decoder_sparse_step``-th (Qwen3-MoE).
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # DeepSeek-family routers (``n_routed_experts``) keep their weight in fp32 whatever the model dtype.
    router_fp32: bool = False

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id``'s MLP routes to experts."""
        return (
            layer_id >= self.first_k_dense_replace
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


def _moe_geometry(text: dict[str, Any], intermediate_size: int) -> Optional[MoEGeometry]:
    experts = text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")
    if not experts:
        return None
    return MoEGeometry(
        num_experts=int(experts),
        top_k=int(text.get("num_experts_per_tok") or 1),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or intermediate_size),
        num_shared_experts=int(text.get("n_shared_experts") or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        first_k_dense_replace=int(text.get("first_k_dense_replace") or 0),
        mlp_only_layers=tuple(int(i) for i in (text.get("mlp_only_layers") or ())),
        decoder_sparse_step=max(1, int(text.get("decoder_sparse_step") or 1)),
        router_fp32=bool(text.get("n_routed_experts")),
    )


@dataclass(frozen=True)
class DraftSpec:
    """Block-diffusion draft settings (DFLASH / DSPARK)."""

    algorithm: str  # "DFLASH" | "DSPARK"
    block_size: int
    mask_token_id: Optional[int]
    target_layer_ids: list[int]
    num_target_layers: Optional[int]
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    # speculators' ``sample_from_anchor``: block slot k predicts token p+k+1 (B drafts, B+1 verified);
    # False is the DFlash convention, slot k predicts p+k (slots 1..B-1: B-1 drafts, B verified).
    sample_from_anchor: bool = False

    @property
    def num_proposed_drafts(self) -> int:
        """Draft tokens one block proposes at the checkpoint's block size."""
        return draft_tokens_per_block(self.block_size, self.sample_from_anchor)


MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def kv_heads_per_rank(total_kv_heads: int, attn_tp_size: int) -> int:
    """KV heads on one rank of an attention-TP group: split when the width divides them, else one head
    replicated when they divide the width; anything else is refused (the plan and the layers call this)."""
    if attn_tp_size < 1:
        raise ValueError(f"attn_tp_size must be >= 1, got {attn_tp_size}")
    if total_kv_heads % attn_tp_size == 0:
        return total_kv_heads // attn_tp_size
    if attn_tp_size % total_kv_heads == 0:
        return 1
    raise ValueError(
        f"num_key_value_heads = {total_kv_heads} cannot be sharded over attention-TP width {attn_tp_size}: "
        "the width must divide the KV heads or be a multiple of them; change --tp-size / --dp-size"
    )


def draft_tokens_per_block(block_size: int, sample_from_anchor: bool) -> int:
    """Drafts a block of ``block_size`` slots proposes: B from the anchor on, or B-1 (slots 1..B-1)."""
    return int(block_size) if sample_from_anchor else int(block_size) - 1


@dataclass
class ModelConfig:
    """Geometry of one model (target or draft), enough to build it and to price its KV."""

    architectures: list[str]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    layer_kinds: list[AttentionKind]
    sliding_window: Optional[int] = None
    swa_num_key_value_heads: Optional[int] = None
    swa_head_dim: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    linear_state: Optional[LinearStateGeometry] = None
    moe: Optional[MoEGeometry] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    kv_cache_quant_algo: Optional[str] = None  # "FP8" when the checkpoint declares an FP8 KV cache
    eos_token_id: Optional[list[int]] = None
    bos_token_id: Optional[int] = None
    draft: Optional[DraftSpec] = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    path: Optional[str] = None

    # ---------------------------------------------------------------- geometry
    def get_num_kv_heads(self, attn_tp_size: int) -> int:
        """KV heads one rank stores at this attention-TP width; heads replicate past the total."""
        return kv_heads_per_rank(self.num_key_value_heads, attn_tp_size)

    def get_swa_num_kv_heads(self, attn_tp_size: int) -> int:
        """KV heads per rank of sliding-window layers (they may differ from full layers)."""
        return kv_heads_per_rank(self.swa_num_key_value_heads or self.num_key_value_heads, attn_tp_size)

    def layer_ids(self, kind: AttentionKind) -> list[int]:
        """Indices of the layers of one attention kind."""
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    @property
    def is_mla(self) -> bool:
        return AttentionKind.MLA in self.layer_kinds and AttentionKind.LINEAR not in self.layer_kinds

    @property
    def is_hybrid_swa(self) -> bool:
        return AttentionKind.SLIDING in self.layer_kinds

    @property
    def is_hybrid_linear(self) -> bool:
        return AttentionKind.LINEAR in self.layer_kinds

    @property
    def mla_kv_dim(self) -> int:
        """Elements per token per MLA layer: kv_lora_rank + qk_rope_head_dim."""
        if self.kv_lora_rank is None or self.qk_rope_head_dim is None:
            raise ModelConfigError(f"{self.model_type}: MLA layers need kv_lora_rank and qk_rope_head_dim")
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_dflash_draft(self) -> bool:
        return self.draft is not None

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        """Read a model directory's config.json, a config.json file itself, or a GGUF file's metadata."""
        from sglite.srt.configs.gguf import find_gguf_file, gguf_metadata_dir

        gguf_file = find_gguf_file(path)
        meta_dir = gguf_metadata_dir(gguf_file) if gguf_file else path
        cfg_file = os.path.join(meta_dir, "config.json") if os.path.isdir(meta_dir) else meta_dir
        if not os.path.isfile(cfg_file):
            raise ModelConfigError(f"no config.json at {path!r}")
        with open(cfg_file) as f:
            raw = json.load(f)
        return cls.from_dict(raw, path=path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Optional[str] = None) -> "ModelConfig":
        """Resolve a parsed config.json."""
        return _parse(raw, path)


# ==================================================================== parsing


_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


def _dtype_of(raw: dict[str, Any], text: dict[str, Any]) -> str:
    """The checkpoint's weight dtype; an unknown name is an error (never silently bf16)."""
    for d in (text, raw):
        for key in ("dtype", "torch_dtype"):
            v = d.get(key)
            if v is None:
                continue
            name = str(v).replace("torch.", "")
            if name not in _DTYPE_ALIASES:
                raise ModelConfigError(
                    f"config.json {key} {v!r} is not a known weight dtype; expected one of {sorted(_DTYPE_ALIASES)}"
                )
            return _DTYPE_ALIASES[name]
    # gpt-oss ships no dtype: attention and embeddings are bf16 (only experts are MXFP4).
    return "bfloat16"


def _rope(text: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return theta, scaling
    theta = float(text.get("rope_theta", 10000.0))
    scaling = text.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def _require(d: dict[str, Any], key: str, model_type: str) -> Any:
    if key not in d or d[key] is None:
        raise ModelConfigError(f"{model_type}: config.json is missing {key!r}")
    return d[key]


def _layer_kinds(text: dict[str, Any], raw: dict[str, Any], n: int, model_type: str) -> list[AttentionKind]:
    is_mla = text.get("kv_lora_rank") is not None
    linear_cfg = text.get("linear_attn_config")
    if linear_cfg:  # Kimi-Linear: 1-based lists of full (MLA) and KDA layers
        full = {i - 1 for i in linear_cfg.get("full_attn_layers", [])}
        attn_kind = AttentionKind.MLA if is_mla else AttentionKind.FULL
        return [attn_kind if i in full else AttentionKind.LINEAR for i in range(n)]
    if text.get("full_attention_interval"):  # Qwen3-Next: every k-th layer is full attention
        k = int(text["full_attention_interval"])
        return [AttentionKind.FULL if (i + 1) % k == 0 else AttentionKind.LINEAR for i in range(n)]
    layer_types = text.get("layer_types")
    if layer_types:
        if len(layer_types) != n:
            raise ModelConfigError(
                f"{model_type}: layer_types has {len(layer_types)} entries for {n} layers"
            )
        mapping = {
            "full_attention": AttentionKind.FULL,
            "sliding_attention": AttentionKind.SLIDING,
            "linear_attention": AttentionKind.LINEAR,
        }
        kinds = []
        for t in layer_types:
            if t not in mapping:
                raise ModelConfigError(f"{model_type}: unknown layer type {t!r} in layer_types")
            kinds.append(mapping[t])
        if is_mla:
            kinds = [AttentionKind.MLA if k == AttentionKind.FULL else k for k in kinds]
        # Qwen-style configs write sliding_window but disable it with use_sliding_window=false.
        if text.get("use_sliding_window") is False:
            kinds = [AttentionKind.FULL if k == AttentionKind.SLIDING else k for k in kinds]
        return kinds
    return [AttentionKind.MLA if is_mla else AttentionKind.FULL] * n


def _linear_state(text: dict[str, Any]) -> Optional[LinearStateGeometry]:
    lc = text.get("linear_attn_config")
    if lc:  # KDA: q, k, v short convolutions; one head_dim x head_dim state per head
        heads, hd = int(lc["num_heads"]), int(lc["head_dim"])
        return LinearStateGeometry(heads, hd, hd, 3 * heads * hd, int(lc.get("short_conv_kernel_size", 4)))
    if text.get("linear_num_value_heads"):  # Gated DeltaNet (Qwen3-Next)
        kh, vh = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
        kd, vd = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
        conv_channels = 2 * kh * kd + vh * vd
        return LinearStateGeometry(vh, kd, vd, conv_channels, int(text.get("linear_conv_kernel_dim", 4)))
    return None


def _draft_spec(raw: dict[str, Any], n_layers: int, model_type: str) -> Optional[DraftSpec]:
    archs = raw.get("architectures") or []
    if any(a in DFLASH_ARCHITECTURES for a in archs):
        algo = "DFLASH"
    elif any(a in DSPARK_ARCHITECTURES for a in archs) or raw.get("markov_rank") is not None:
        algo = "DSPARK"
    elif "dflash_config" in raw:
        algo = "DFLASH"
    else:
        return None
    nested = raw.get("dflash_config") or {}

    def pick(key: str, default: Any = None) -> Any:
        return nested.get(key, raw.get(key, default))

    num_target_layers = pick("num_target_layers")
    target_layer_ids = pick("target_layer_ids")
    if target_layer_ids is None:
        if num_target_layers is None:
            raise ModelConfigError(
                f"{algo} draft: config.json has neither target_layer_ids nor num_target_layers, "
                "so the target layers to capture cannot be resolved"
            )
        target_layer_ids = build_target_layer_ids(int(num_target_layers), n_layers)
    markov_rank = int(pick("markov_rank", 0) or 0)
    if algo == "DSPARK" and markov_rank <= 0:
        raise ModelConfigError("DSPARK draft: markov_rank must be > 0")
    head_type = str(pick("markov_head_type", "vanilla"))
    if algo == "DSPARK" and head_type not in MARKOV_HEAD_TYPES:
        raise ModelConfigError(f"DSPARK draft: markov_head_type {head_type!r} is not one of {list(MARKOV_HEAD_TYPES)}")
    # speculators: DSpark defaults to sampling from the anchor, DFlash to the mask slots only.
    sample_from_anchor = bool(pick("sample_from_anchor", algo == "DSPARK"))
    return DraftSpec(
        algorithm=algo,
        block_size=int(pick("block_size", 16)),
        mask_token_id=pick("mask_token_id"),
        target_layer_ids=[int(i) for i in target_layer_ids],
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        markov_rank=markov_rank,
        markov_head_type=head_type,
        enable_confidence_head=bool(pick("enable_confidence_head", False)),
        confidence_head_with_markov=bool(pick("confidence_head_with_markov", markov_rank > 0)),  # speculators default
        sample_from_anchor=sample_from_anchor,
    )


def _parse(raw: dict[str, Any], path: Optional[str]) -> ModelConfig:
    text = raw.get("text_config") or raw
    model_type = str(text.get("model_type") or raw.get("model_type") or "unknown")
    archs = list(raw.get("architectures") or text.get("architectures") or [])
    n = int(_require(text, "num_hidden_layers", model_type))
    hidden = int(_require(text, "hidden_size", model_type))
    heads = int(_require(text, "num_attention_heads", model_type))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    kinds = _layer_kinds(text, raw, n, model_type)
    is_mla = text.get("kv_lora_rank") is not None
    if is_mla:
        head_dim = int(text.get("qk_nope_head_dim", 0)) + int(_require(text, "qk_rope_head_dim", model_type))
        v_head_dim = int(_require(text, "v_head_dim", model_type))
    else:
        head_dim = int(text.get("head_dim") or hidden // heads)
        v_head_dim = int(text.get("v_head_dim") or head_dim)
    theta, scaling = _rope(text)
    quant = raw.get("quantization_config") or {}
    kv_quant = quant.get("kv_cache_quant_algo") or (raw.get("kv_cache_scheme") and "FP8")
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if isinstance(eos, int):
        eos = [eos]
    max_pos = text.get("max_position_embeddings") or raw.get("model_max_length") or 4096
    cfg = ModelConfig(
        architectures=archs,
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        vocab_size=int(_require(text, "vocab_size", model_type)),
        intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
        max_position_embeddings=int(max_pos),
        dtype=_dtype_of(raw, text),
        layer_kinds=kinds,
        sliding_window=text.get("sliding_window") if AttentionKind.SLIDING in kinds else None,
        kv_lora_rank=text.get("kv_lora_rank"),
        qk_rope_head_dim=text.get("qk_rope_head_dim"),
        linear_state=_linear_state(text) if AttentionKind.LINEAR in kinds else None,
        moe=_moe_geometry(text, int(text.get("intermediate_size") or 4 * hidden)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # Absent means tied: transformers' PretrainedConfig default (Gemma 3 ships no key and ties).
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        attention_bias=bool(text.get("attention_bias", False)),
        hidden_act=str(text.get("hidden_act", text.get("hidden_activation", "silu"))),
        kv_cache_quant_algo=str(kv_quant).upper() if kv_quant else None,
        eos_token_id=eos,
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        draft=_draft_spec(raw, n, model_type),
        hf_config=raw,
        path=path,
    )
    if AttentionKind.SLIDING in kinds and not cfg.sliding_window:
        raise ModelConfigError(f"{model_type}: sliding layers but no sliding_window in config.json")
    if AttentionKind.LINEAR in kinds and cfg.linear_state is None:
        raise ModelConfigError(f"{model_type}: linear-attention layers but no recurrent-state geometry")
    if cfg.draft is not None and cfg.draft.mask_token_id is not None and cfg.draft.mask_token_id < 0:
        raise ModelConfigError(f"{cfg.draft.algorithm} draft: mask_token_id must be >= 0")
    return cfg
