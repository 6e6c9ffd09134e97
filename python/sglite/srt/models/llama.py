"""Llama-family decoder (LlamaForCausalLM) with TP layers, paged attention and aux hidden-state capture.

Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) reuse these classes through two switches,
``qkv_bias`` and ``qk_norm``, set by their subclasses in qwen2.py / qwen3.py.

The per-layer submodules are run with ``.forward(...)`` rather than called: nothing registers hooks on
them, and ``nn.Module.__call__``'s hook checks cost ~1.5 us a call, ~330 calls per decode step, which a
CPU decode step of a small model pays in full (docs/benchmarks.md, "SmolLM2 decode profile").
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from sglite.srt.configs.model_config import AttentionKind, ModelConfig
from sglite.srt.distributed.parallel_state import (
    GroupCoordinator,
    get_attn_dp_peer_group,
    get_attn_tp_group,
    get_tp_group,
)
from sglite.srt.layers.activation import SiluAndMul
from sglite.srt.layers.attention.radix_attention import RadixAttention
from sglite.srt.layers.dp_attention import DpTokenLayout, exchange_layout, exchanges_tokens, run_over_all_groups
from sglite.srt.layers.layernorm import RMSNorm, rms_normalize
from sglite.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglite.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglite.srt.layers.rotary_embedding import get_rope
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.srt.model_executor.forward_batch_info import ForwardBatch
from sglite.srt.model_loader.weight_utils import WeightLoadingError, load_named_weights
from sglite.srt.runtime_context import check_attn_cp_supported, get_parallel


def model_tp_group() -> GroupCoordinator:
    """The group a Llama-family model's attention (and a draft's whole model) is sharded over: attention TP.

    Without DP attention it is the whole TP group. With DP attention it is this rank's attention-DP
    group, the width the KV plan prices pools at; the target's MLPs and LM head still run over the
    whole TP group (``model_mlp_group``) with a token exchange across attention-DP groups.
    Attention context parallelism (sequence split over ranks) is not implemented: a clear error.
    """
    check_attn_cp_supported(get_parallel().attn_cp_size)
    return get_attn_tp_group()


def model_mlp_group() -> GroupCoordinator:
    """The group the target's MLPs and LM head are sharded over: the whole TP group (SGLang's split)."""
    model_tp_group()  # same support checks
    return get_tp_group()


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
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


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
        qkv = self.qkv_proj.forward(hidden_states)
        t, q_heads, d = qkv.shape[0], self.num_heads, self.head_dim
        # q and k heads sit side by side in the fused output: normalise and rotate them as one
        # [T, H + Hkv, D] tensor (half the per-layer ops of doing q and k apart; same values).
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # split_with_sizes: one op for both views (each op costs a dispatch on a CPU decode step).
        qk, v = qkv.split_with_sizes([q_size + kv_size, self.qkv_proj.v_size], dim=-1)
        qk = qk.view(t, q_heads + self.num_kv_heads, d)
        if self.qk_norm:
            qk = rms_normalize(qk, self.q_norm.variance_epsilon)  # a new tensor: scaled in place below
            q_w, k_w = self.q_norm.weight, self.k_norm.weight
            if q_w.dtype == qk.dtype and k_w.dtype == qk.dtype:
                qk[:, :q_heads] *= q_w
                qk[:, q_heads:] *= k_w
            else:  # weights in another dtype promote the result, as RMSNorm does
                qk = torch.cat((q_w * qk[:, :q_heads], k_w * qk[:, q_heads:]), dim=1)
        qk = self.rotary_emb.rotate_heads(positions, qk)
        q, k = qk.split_with_sizes([q_heads, self.num_kv_heads], dim=1)  # [T, H, D] / [T, Hkv, D]: attn takes either
        return self.o_proj.forward(self.attn.forward(q, k, v, forward_batch))


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
        mlp: Optional[nn.Module] = None,
        self_attn: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        # ``self_attn`` / ``mlp``: a family's own blocks (MLA, an MoE layer) with the same forward signatures.
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(
            config, layer_id, attn_tp_group, qkv_bias, o_bias, qk_norm
        )
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias, tp_group
        )
        self.dp_peers = get_attn_dp_peer_group()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
        dp_layout: Optional[DpTokenLayout] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual); the layer's true output is their sum.

        ``dp_layout`` (DP attention): the MLP runs over every attention-DP group's tokens.
        """
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        if dp_layout is None:
            return self.mlp.forward(hidden_states), residual
        return run_over_all_groups(self.mlp, hidden_states, self.dp_peers, dp_layout), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(
        self,
        config: ModelConfig,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        mlp_bias: bool,
        build_mlp: Optional[Callable[[int, GroupCoordinator], Optional[nn.Module]]] = None,
        build_attention: Optional[Callable[[int, GroupCoordinator], Optional[nn.Module]]] = None,
    ) -> None:
        super().__init__()
        self.config = config
        attn_tp_group, mlp_group = model_tp_group(), model_mlp_group()
        # The embedding stays within the attention-DP group: its lookups need no other group's tokens.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=attn_tp_group)
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(
                    config, i, attn_tp_group, mlp_group, qkv_bias, o_bias, qk_norm, mlp_bias,
                    mlp=build_mlp(i, mlp_group) if build_mlp is not None else None,
                    self_attn=build_attention(i, attn_tp_group) if build_attention is not None else None,
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.dp_peers = get_attn_dp_peer_group()
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
        # One count exchange per forward serves every layer's MLP (same rows throughout).
        dp_layout = None
        if exchanges_tokens(self.dp_peers):
            dp_layout = exchange_layout(hidden_states.shape[0], self.dp_peers, hidden_states.device)
        # The layers share one rotary module (get_rope): its cos/sin rows are gathered once per forward.
        with self.layers[0].self_attn.rotary_emb.shared_rows(positions):
            for i, layer in enumerate(self.layers):
                hidden_states, residual = layer.forward(positions, hidden_states, forward_batch, residual, dp_layout)
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
            build_mlp=self.build_mlp,
            build_attention=self.build_attention,
        )
        head_group = model_mlp_group()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=head_group)
        # Under DP attention the embedding (attention-TP shards) and the head (TP shards) split the
        # vocabulary differently, so a tied checkpoint tensor is loaded into both instead of shared.
        self.shares_embedding_weight = (
            config.tie_word_embeddings and head_group.world_size == self.model.embed_tokens.tp_size
        )
        if self.shares_embedding_weight:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(
            config.vocab_size, tp_group=head_group, dp_peer_group=get_attn_dp_peer_group()
        )

    def build_mlp(self, layer_id: int, mlp_group: GroupCoordinator) -> Optional[nn.Module]:
        """The feed-forward block of layer ``layer_id``; None = the dense gated MLP (a subclass's hook for MoE)."""
        return None

    def build_attention(self, layer_id: int, attn_tp_group: GroupCoordinator) -> Optional[nn.Module]:
        """The attention block of layer ``layer_id``; None = Llama's GQA attention (a subclass's hook for MLA)."""
        return None

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
        tied = ("lm_head.weight",) if self.shares_embedding_weight else ()
        if self.config.tie_word_embeddings and not self.shares_embedding_weight:
            weights = _with_untied_head(weights)
        loaded = load_named_weights(self, weights, self.stacked_params_mapping, skip_suffixes=skip, tied_names=tied)
        if self.config.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded


def _with_untied_head(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, with the embedding also loaded into the (separately sharded) LM head.

    A tied checkpoint that stores ``lm_head.weight`` anyway loads the same values twice.
    """
    for name, tensor in weights:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "WeightLoadingError"]
