"""DFLASH block-diffusion draft (public `DFlashDraftModel` checkpoints): Qwen3-style layers over the target's features.

The draft has no embedding and no LM head: the block ``[bonus, MASK x (B-1)]`` is embedded with the
target's embedding, and block rows are projected with the target's LM head (attached with
``attach_target_head``). Target features (outputs of ``target_layer_ids``, concatenated) are fused by
``fc`` + ``hidden_norm`` into one context vector per committed token; every layer projects that
vector with its own k/v projection (k_norm, then RoPE at the token's position) into the draft KV pool
(``write_context_kv``). The block then attends non-causally over context KV ++ block KV
(ForwardMode.DRAFT_BLOCK).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglite.srt.configs.model_config import AttentionKind, ModelConfig
from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.cpu_bf16_projection import Bf16Projection
from sglite.srt.layers.hot_vocab_head import HotVocabHead
from sglite.srt.layers.layernorm import RMSNorm
from sglite.srt.layers.linear import ReplicatedLinear
from sglite.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.srt.model_executor.forward_batch_info import ForwardBatch
from sglite.srt.model_loader.weight_utils import (
    WeightLoadingError,
    describe_missing,
    expected_loads,
    load_named_weights,
)
from sglite.srt.models.llama import LlamaAttention, LlamaMLP, model_tp_group


class DFlashAttention(LlamaAttention):
    """Self-attention of one draft layer (a Qwen3 attention block); also projects context features into its K/V.

    Every draft layer is full attention (checked by DFlashDraftModel), so the inherited block never
    gets a sliding window; its forward is the block queries over context KV ++ block KV.
    """

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_group: GroupCoordinator, params_dtype: Optional[torch.dtype] = None
    ) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_id, tp_group, qkv_bias=bias, o_bias=bias, qk_norm=True, params_dtype=params_dtype)
        self.context_kv_bf16: Optional[Bf16Projection] = None  # the K/V rows in bf16 (DFlashDraftModel.project_context_in_bf16)

    def _context_kv_rows(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The K and V rows of the fused qkv weight (and bias): a context vector needs no query."""
        q_size = self.qkv_proj.q_size
        return self.qkv_proj.weight[q_size:], None if self.qkv_proj.bias is None else self.qkv_proj.bias[q_size:]

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K [n, Hkv, D] (k_norm, RoPE) and V [n, Hkv, D] of fused context vectors (no query is computed)."""
        if self.context_kv_bf16 is not None and self.context_kv_bf16.serves(context.shape[0]):
            kv = self.context_kv_bf16(context)
        else:
            kv = F.linear(context, *self._context_kv_rows())
        k, v = kv.split([self.qkv_proj.kv_size, self.qkv_proj.v_size], dim=-1)
        k = self._norm_heads(self.k_norm, k)
        _, k = self.rotary_emb(positions, k, k)
        n = context.shape[0]
        return k.reshape(n, self.num_kv_heads, self.head_dim), v.reshape(n, self.num_kv_heads, self.head_dim)


class DFlashMLP(LlamaMLP):
    """SiLU-gated MLP without biases (the Llama MLP at the draft's sizes and dtype)."""

    def __init__(
        self, config: ModelConfig, tp_group: GroupCoordinator, params_dtype: Optional[torch.dtype] = None
    ) -> None:
        super().__init__(
            config.hidden_size, config.intermediate_size, config.hidden_act, False, tp_group, params_dtype
        )


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_group: GroupCoordinator, params_dtype: Optional[torch.dtype] = None
    ) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_id, tp_group, params_dtype)
        self.mlp = DFlashMLP(config, tp_group, params_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, params_dtype=params_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, params_dtype=params_dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """h + attn(norm(h)), then + mlp(norm(.))."""
        h = hidden + self.self_attn(positions, self.input_layernorm(hidden), forward_batch)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftProposal:
    """One block's drafts per request and, for a DSPARK draft with a confidence head, their acceptance logits."""

    ids: torch.Tensor  # [bs, n] drafts, n = draft_tokens_per_block(B, sample_from_anchor)
    confidence_logits: Optional[torch.Tensor] = None  # [bs, n] fp32


# Names the draft takes from the target: speculators reloads embed_tokens from the verifier and uses the
# verifier's lm_head for a full-vocabulary draft, and SGLang skips both; checkpoint copies are dropped.
TARGET_OWNED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


class DFlashDraftModel(nn.Module):
    """The DFLASH draft; uses the target's embedding and LM head (see ``attach_target_head``)."""

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if config.draft is None:
            raise ValueError(
                f"{config.path or 'draft'}: config.json has no DFLASH settings (architectures "
                f"{config.architectures}); expected DFlashDraftModel with dflash_config"
            )
        if any(k != AttentionKind.FULL for k in config.layer_kinds) or config.hf_config.get("is_causal"):
            raise ValueError(
                "DFLASH draft: only full non-causal attention layers are supported "
                f"(layer kinds {[k.value for k in config.layer_kinds]}, is_causal={config.hf_config.get('is_causal')})"
            )
        self.config = config
        self.draft_spec = config.draft
        self.block_size = config.draft.block_size
        self.mask_token_id = config.draft.mask_token_id
        self.target_layer_ids = list(config.draft.target_layer_ids)
        hidden = config.hidden_size
        # Sharded like the target (its attention-TP group), so the draft pool's heads per rank match.
        tp_group = model_tp_group()
        self.layers = nn.ModuleList(
            [DFlashDecoderLayer(config, i, tp_group, params_dtype) for i in range(config.num_hidden_layers)]
        )
        self.fc = ReplicatedLinear(len(self.target_layer_ids) * hidden, hidden, bias=False, params_dtype=params_dtype)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps, params_dtype=params_dtype)
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps, params_dtype=params_dtype)
        self.input_embedding_scale = float(_draft_extra(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(_draft_extra(config, "output_multiplier", 1.0))
        softcap = _draft_extra(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(softcap) if softcap else None
        # The target's modules, attached by the worker; kept out of this module's parameters.
        self._target: Optional[tuple[VocabParallelEmbedding, ParallelLMHead, LogitsProcessor]] = None
        # --speculative-token-map: drafts come from these rows of the target head only (restrict_draft_vocab).
        self.hot_head: Optional[HotVocabHead] = None
        self.fc_bf16: Optional[Bf16Projection] = None  # fc in bf16 for wide context writes (project_context_in_bf16)

    # ------------------------------------------------------------------ target head
    def attach_target_head(
        self, embed_tokens: VocabParallelEmbedding, lm_head: ParallelLMHead, logits_processor: LogitsProcessor
    ) -> None:
        """Use the target's embedding and LM head (the draft has none of its own)."""
        if embed_tokens.embedding_dim != self.config.hidden_size:
            raise ValueError(
                f"draft hidden_size {self.config.hidden_size} != target hidden_size {embed_tokens.embedding_dim}"
            )
        if self.mask_token_id is None or not 0 <= self.mask_token_id < embed_tokens.num_embeddings:
            raise ValueError(
                f"draft mask_token_id {self.mask_token_id} must be set and below the target vocab "
                f"{embed_tokens.num_embeddings} (set dflash_config.mask_token_id in the draft config.json)"
            )
        self._target = (embed_tokens, lm_head, logits_processor)

    def _target_modules(self) -> tuple[VocabParallelEmbedding, ParallelLMHead, LogitsProcessor]:
        if self._target is None:
            raise RuntimeError("DFLASH draft used before attach_target_head(target embed, lm_head, logits_processor)")
        return self._target

    def get_embed_tokens(self) -> VocabParallelEmbedding:
        """The (target's) embedding the block is embedded with."""
        return self._target_modules()[0]

    def get_lm_head(self) -> ParallelLMHead:
        """The (target's) LM head draft rows are projected with."""
        return self._target_modules()[1]

    def restrict_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft from ``token_ids`` only: logits come from those rows of the (attached) target head."""
        self.hot_head = HotVocabHead(self._target_modules()[1], token_ids)

    def to_vocab_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of argmax indices over ``compute_logits`` columns (identity without a token map)."""
        return index if self.hot_head is None else self.hot_head.to_vocab_ids(index)

    def embed_block(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of block tokens, times the checkpoint's input_embedding_scale."""
        emb = self._target_modules()[0](input_ids)
        return emb * self.input_embedding_scale if self.input_embedding_scale != 1.0 else emb

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of draft rows: the full vocabulary through the target LM head (gathered under TP), or
        the token map's columns through the hot head (``to_vocab_ids`` maps columns back to token ids)."""
        _, lm_head, proc = self._target_modules()
        logits = proc.compute_logits(hidden, lm_head) if self.hot_head is None else self.hot_head(hidden)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    # ------------------------------------------------------------------ context KV
    def fuse_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(concatenated target features)): one context vector per token."""
        expected = len(self.target_layer_ids) * self.config.hidden_size
        if aux_hidden.shape[-1] != expected:
            raise ValueError(
                f"target features have width {aux_hidden.shape[-1]}, the draft's fc expects {expected} "
                f"({len(self.target_layer_ids)} layers x {self.config.hidden_size})"
            )
        x = aux_hidden.to(self.fc.weight.dtype)
        wide = self.fc_bf16 is not None and self.fc_bf16.serves(x.shape[0])
        return self.hidden_norm(self.fc_bf16(x) if wide else self.fc(x))

    def project_context_in_bf16(self) -> int:
        """Project wide context writes (``fc``, each layer's K/V rows) through bf16 copies of the weights as they
        are now (``layers/cpu_bf16_projection.py``); returns the bytes of the copies."""
        if self.fc.weight.dtype != torch.float32 or self.fc.weight.device.type != "cpu":
            raise ValueError(f"bf16 context projections copy fp32 CPU weights, not {self.fc.weight.dtype} on {self.fc.weight.device}")
        self.fc_bf16 = Bf16Projection(self.fc.weight)
        for layer in self.layers:
            layer.self_attn.context_kv_bf16 = Bf16Projection(*layer.self_attn._context_kv_rows())
        return self.fc_bf16.nbytes() + sum(layer.self_attn.context_kv_bf16.nbytes() for layer in self.layers)

    @torch.no_grad()
    def write_context_kv(
        self, aux_hidden: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, token_to_kv_pool
    ) -> None:
        """Write every draft layer's context K/V of these tokens into the draft pool at the target's slots."""
        if aux_hidden.shape[0] != positions.shape[0] or positions.shape[0] != out_cache_loc.shape[0]:
            raise ValueError(
                f"write_context_kv: {aux_hidden.shape[0]} feature rows, {positions.shape[0]} positions, "
                f"{out_cache_loc.shape[0]} slots"
            )
        if aux_hidden.shape[0] == 0:
            return
        context = self.fuse_context(aux_hidden)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(context, positions)
            token_to_kv_pool.set_kv_buffer(i, out_cache_loc, k, v)

    # ------------------------------------------------------------------ block forward
    def block_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Final-normed hidden states [T, H] of the block tokens (DRAFT_BLOCK over context KV)."""
        if not forward_batch.forward_mode.is_draft_block():
            raise ValueError(f"the DFLASH draft runs blocks in DRAFT_BLOCK mode, got {forward_batch.forward_mode.name}")
        h = forward_batch.input_embeds if forward_batch.input_embeds is not None else self.embed_block(input_ids)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.norm(h)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Block forward; logits for every block row through the target LM head."""
        hidden = self.block_hidden(input_ids, positions, forward_batch)
        return LogitsProcessorOutput(next_token_logits=self.compute_logits(hidden), hidden_states=hidden)

    def propose_drafts(self, out: LogitsProcessorOutput, forward_batch: ForwardBatch, block_size: int) -> DraftProposal:
        """Drafts: argmax of the target LM head over block rows 1..B-1 (0..B-1 with sample_from_anchor)."""
        logits = out.next_token_logits.reshape(forward_batch.batch_size, block_size, -1)
        first = 0 if self.draft_spec.sample_from_anchor else 1
        return DraftProposal(ids=self.to_vocab_ids(logits[:, first:].argmax(dim=-1)))

    # ------------------------------------------------------------------ weights
    # checkpoint name fragment -> (fused parameter fragment, shard id): the draft layers fuse q/k/v and
    # gate/up as the Llama-family targets do, matched with their module (DSPARK's
    # ``markov_head.gate_proj`` is not an MLP gate).
    stacked_params_mapping = (
        (".self_attn.q_proj", ".self_attn.qkv_proj", "q"),
        (".self_attn.k_proj", ".self_attn.qkv_proj", "k"),
        (".self_attn.v_proj", ".self_attn.qkv_proj", "v"),
        (".mlp.gate_proj", ".mlp.gate_up_proj", 0),
        (".mlp.up_proj", ".mlp.gate_up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the draft's own tensors; an unknown or missing tensor is an error naming it.

        ``embed_tokens`` / ``lm_head`` copies (released DSPARK checkpoints ship them) must have the
        full-vocabulary shape and are dropped: the draft uses the target's (see TARGET_OWNED_TENSORS).
        """
        full = (self.config.vocab_size, self.config.hidden_size)

        def own(named: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in named:
                if name not in TARGET_OWNED_TENSORS:
                    yield name, tensor
                elif tuple(tensor.shape) != full:
                    raise WeightLoadingError(
                        f"draft checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, not the full vocabulary "
                        f"{full}: reduced-vocabulary drafts (d2t/t2d) are not supported"
                    )

        loaded = load_named_weights(self, own(weights), self.stacked_params_mapping)
        missing = expected_loads(self, self.stacked_params_mapping) - loaded
        if missing:
            names = describe_missing(missing, self.stacked_params_mapping)
            raise WeightLoadingError(f"draft checkpoint is missing {len(names)} tensor(s): {names[:8]}")
        return loaded


def _draft_extra(config: ModelConfig, key: str, default):
    nested = config.hf_config.get("dflash_config") or {}
    return nested.get(key, config.hf_config.get(key, default))


EntryClass = DFlashDraftModel
