"""Llama-family decoder (LlamaForCausalLM) with TP layers, paged attention and aux hidden-state capture.

Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) reuse these classes through two switches,
``qkv_bias`` and ``qk_norm``, set by their subclasses in qwen2.py / qwen3.py.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from sglite.srt.configs.model_config import AttentionKind, ModelConfig
from sglite.srt.distributed.parallel_state import GroupCoordinator, get_attn_tp_group
from sglite.srt.layers.activation import SiluAndMul
from sglite.srt.layers.attention.radix_attention import RadixAttention
from sglite.srt.layers.layernorm import RMSNorm
from sglite.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglite.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglite.srt.layers.rotary_embedding import get_rope
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.srt.model_executor.forward_batch_info import ForwardBatch
from sglite.srt.model_loader.weight_utils import WeightLoadingError, load_named_weights
from sglite.srt.runtime_context import get_parallel


def model_tp_group() -> GroupCoordinator:
    """The group a Llama-family model is sharded over: the attention-TP group.

    Without DP attention it is the whole TP group. With DP attention each attention-DP group runs a
    full model replica sharded over its attn_tp ranks (MLP and vocab included), so the requests of one
    DP group never need another group's tokens; the KV plan prices pools at attn_tp either way.
    Attention context parallelism (sequence split over ranks) is not implemented: a clear error.
    """
    if get_parallel().attn_cp_size > 1:
        raise ValueError(
            f"--attn-cp-size {get_parallel().attn_cp_size}: attention context parallelism is not implemented "
            "for Llama-family models; use --attn-cp-size 1"
        )
    return get_attn_tp_group()


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel (fused), down row-parallel."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        tp_group: GroupCoordinator,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, params_dtype=params_dtype, tp_group=tp_group
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, params_dtype=params_dtype, tp_group=tp_group
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gated MLP."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """QKV projection, optional q/k norm, rotary, paged attention, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp_group: GroupCoordinator,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
            params_dtype=params_dtype,
            tp_group=tp_group,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=o_bias,
            params_dtype=params_dtype,
            tp_group=tp_group,
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps, params_dtype=params_dtype)
            self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps, params_dtype=params_dtype)
        self.rotary_emb = get_rope(
            config.head_dim, config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        kind = config.layer_kinds[layer_id]
        if kind not in (AttentionKind.FULL, AttentionKind.SLIDING):
            raise ValueError(f"layer {layer_id}: attention kind {kind.value!r} is not supported by Llama-family models")
        self.attn = RadixAttention(
            self.num_heads,
            config.head_dim,
            config.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window=config.sliding_window if kind == AttentionKind.SLIDING else None,
        )

    def _norm_heads(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of ``[t, heads * head_dim]`` rows."""
        return norm(x.reshape(-1, x.shape[-1] // self.head_dim, self.head_dim)).reshape(x.shape)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Self-attention of the new tokens over their requests' cached keys."""
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))
        if self.qk_norm:
            q = self._norm_heads(self.q_norm, q)
            k = self._norm_heads(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, forward_batch))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with the residual stream carried un-normalised."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        attn_tp_group: GroupCoordinator,
        tp_group: GroupCoordinator,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        mlp_bias: bool,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = LlamaAttention(config, layer_id, attn_tp_group, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual); the layer's true output is their sum."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.config = config
        tp_group = model_tp_group()
        attn_tp_group = tp_group
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp_group)
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(config, i, attn_tp_group, tp_group, qkv_bias, o_bias, qk_norm, mlp_bias)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(final normed hidden states [T, hidden], aux hidden states [T, k*hidden] or None)."""
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        capture = forward_batch.capture_aux_hidden_layers
        if capture:
            bad = [i for i in capture if not 0 <= i < len(self.layers)]
            if bad:
                raise ValueError(f"capture_aux_hidden_layers {bad} outside the model's {len(self.layers)} layers")
        captured: dict[int, torch.Tensor] = {}
        residual: Optional[torch.Tensor] = None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
            if capture and i in capture:
                captured[i] = hidden_states + residual  # the layer's output (DFlash target_layer_ids rule)
        hidden_states, _ = self.norm(hidden_states, residual)
        aux = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return hidden_states, aux


class LlamaForCausalLM(nn.Module):
    """Llama causal LM: model + vocab-parallel LM head + logits processor."""

    qkv_bias_default = False
    qk_norm = False
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params_mapping = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hf = config.hf_config.get("text_config") or config.hf_config
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = attention_bias or self.qkv_bias_default
        self.model = LlamaModel(
            config,
            qkv_bias=qkv_bias,
            o_bias=attention_bias and not self.qkv_bias_default,
            qk_norm=self.qk_norm,
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )
        tp_group = model_tp_group()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp_group)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, tp_group=tp_group)

    def get_embed_tokens(self) -> VocabParallelEmbedding:
        """The (vocab-parallel) input embedding."""
        return self.model.embed_tokens

    def get_lm_head(self) -> ParallelLMHead:
        """The (vocab-parallel) output projection."""
        return self.lm_head

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> LogitsProcessorOutput:
        """Logits for the rows the forward mode asks for; ``input_embeds`` (or the batch's) replaces the lookup."""
        if input_embeds is None:
            input_embeds = forward_batch.input_embeds
        hidden_states, aux = self.model(input_ids, positions, forward_batch, input_embeds)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch, aux)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (q/k/v and gate/up fused on the fly); returns the parameter names filled."""
        skip = ("rotary_emb.inv_freq",)
        tied = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        loaded = load_named_weights(self, weights, self.stacked_params_mapping, skip_suffixes=skip, tied_names=tied)
        if self.config.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "WeightLoadingError"]
