"""DSPARK draft: the DFLASH backbone plus a low-rank Markov head and an optional confidence head.

Layout and semantics follow the released checkpoints (SGLang 0.5.23 module names) and the
``speculators`` reference (``speculators/models/dspark``):

- ``markov_head.markov_w1`` (Embedding [V, r]) embeds the previous token, ``markov_head.markov_w2``
  (Linear r -> V, no bias) projects to a logit bias. Head types: ``vanilla`` bias = w2(e);
  ``gated`` bias = w2(sigmoid(gate_proj([h; e])) * e); ``rnn`` a recurrent state over the block
  positions, ``joint_proj([s; e; h]) -> (gate, candidate, out)``, bias = w2(tanh(out)).
- ``confidence_head.proj`` (Linear -> 1, with bias) scores each slot's acceptance from ``h`` (and
  ``e`` with ``confidence_head_with_markov``).
- ``sample_from_anchor`` (default True for DSPARK): slot k predicts token p+k+1, so a block of B
  slots proposes B drafts and the target verifies B+1 tokens; slot k's Markov input is the token at
  p+k (the anchor for slot 0, then each draft in turn: drafted left to right). With it False the
  DFlash convention holds (slots 1..B-1, slot k conditioned on the token at p+k-1).
- Like DFLASH, the block is embedded with the target's embedding and projected with the target's LM
  head: speculators always reloads ``embed_tokens`` from the verifier and uses the verifier's
  ``lm_head`` for a full-vocabulary draft, and SGLang skips both names. Checkpoint copies are shape
  checked and dropped (``DFlashDraftModel.load_weights``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglite.srt.configs.model_config import MARKOV_HEAD_TYPES, ModelConfig
from sglite.srt.layers.linear import ReplicatedLinear
from sglite.srt.layers.logits_processor import LogitsProcessorOutput
from sglite.srt.model_executor.forward_batch_info import ForwardBatch
from sglite.srt.models.dflash import DFlashDraftModel, DraftProposal


class DSparkMarkovHead(nn.Module):
    """Previous-token logit bias, one block slot at a time (``step``) so drafts can feed the next slot."""

    def __init__(
        self, vocab_size: int, rank: int, hidden_size: int, head_type: str, params_dtype: Optional[torch.dtype]
    ) -> None:
        super().__init__()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"DSPARK markov_head_type {head_type!r} is not one of {list(MARKOV_HEAD_TYPES)}")
        self.head_type, self.rank = head_type, rank
        dtype = params_dtype or torch.get_default_dtype()
        self.markov_w1 = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.markov_w1.weight.requires_grad_(False)
        self.markov_w2 = ReplicatedLinear(rank, vocab_size, bias=False, params_dtype=params_dtype)
        if head_type == "gated":
            self.gate_proj = ReplicatedLinear(hidden_size + rank, rank, bias=True, params_dtype=params_dtype)
        elif head_type == "rnn":
            self.joint_proj = ReplicatedLinear(2 * rank + hidden_size, 3 * rank, bias=True, params_dtype=params_dtype)

    def restrict_output(self, token_ids: torch.Tensor) -> None:
        """Bias only these vocabulary columns (--speculative-token-map): ``markov_w2`` keeps their rows alone,
        so a step computes no bias the draft's argmax would throw away."""
        w2 = self.markov_w2
        if w2.packed_weight is not None:
            raise RuntimeError("restrict_output must run before the CPU pack (it would keep the full-vocabulary copy)")
        w2.weight = nn.Parameter(w2.weight.data.index_select(0, token_ids.to(w2.weight.device)), requires_grad=False)
        w2.output_size = int(token_ids.numel())

    def embed_prev(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """markov_w1 rows of the previous tokens."""
        return self.markov_w1(prev_ids.long())

    def initial_state(self, n: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The rnn head's zero state [n, r] at block slot 0 (None for the stateless heads)."""
        return like.new_zeros(n, self.rank) if self.head_type == "rnn" else None

    def step(
        self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(fp32 bias [n, V] (the map's columns after ``restrict_output``), next state) of one block slot from its
        previous-token embedding and hidden row."""
        e = prev_emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(e).float(), state
        h = hidden.to(e.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return self.markov_w2(gate * e).float(), state
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)).float(), state


class DSparkConfidenceHead(nn.Module):
    """Per-slot acceptance logit: ``proj`` (Linear -> 1, with bias)."""

    def __init__(self, input_dim: int, params_dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.proj = ReplicatedLinear(input_dim, 1, bias=True, params_dtype=params_dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n]."""
        return self.proj(features.to(self.proj.weight.dtype)).float()[..., 0]


class DSparkDraftModel(DFlashDraftModel):
    """DFLASH backbone + Markov head drafted left to right + optional confidence head."""

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(config, params_dtype)
        spec = config.draft
        if spec.algorithm != "DSPARK":
            raise ValueError(f"{config.path or 'draft'}: not a DSPARK config (architectures {config.architectures})")
        self.markov_rank = spec.markov_rank
        self.markov_head = DSparkMarkovHead(
            config.vocab_size, spec.markov_rank, config.hidden_size, spec.markov_head_type, params_dtype
        )
        self.confidence_with_markov = spec.confidence_head_with_markov
        self.confidence_head: Optional[DSparkConfidenceHead] = None
        if spec.enable_confidence_head:
            width = config.hidden_size + (spec.markov_rank if self.confidence_with_markov else 0)
            self.confidence_head = DSparkConfidenceHead(width, params_dtype)

    def restrict_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft from ``token_ids`` only: the hot head's logits and the Markov bias both cover just those columns."""
        super().restrict_draft_vocab(token_ids)
        self.markov_head.restrict_output(token_ids)

    def confidence_logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """Confidence-head logits [n] of slots with hidden rows ``hidden`` and previous-token embeddings."""
        if self.confidence_head is None:
            raise ValueError("this DSPARK checkpoint has no confidence head (enable_confidence_head is false)")
        x = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1) if self.confidence_with_markov else hidden
        return self.confidence_head(x)

    def propose_drafts(self, out: LogitsProcessorOutput, forward_batch: ForwardBatch, block_size: int) -> DraftProposal:
        """Drafts [bs, n]: slot by slot, argmax(target-head logits + Markov bias of the slot's previous token).

        n is B with ``sample_from_anchor`` (slots 0..B-1) and B-1 without (slots 1..B-1); the
        confidence logits of the drafting slots come along when the checkpoint has the head.
        """
        bs = forward_batch.batch_size
        logits = out.next_token_logits.reshape(bs, block_size, -1)
        hidden = out.hidden_states.reshape(bs, block_size, -1)
        first = 0 if self.draft_spec.sample_from_anchor else 1
        prev = forward_batch.input_ids.reshape(bs, block_size)[:, 0]
        state = self.markov_head.initial_state(bs, hidden)
        drafts, conf = [], []
        for k in range(block_size):
            emb = self.markov_head.embed_prev(prev)
            bias, state = self.markov_head.step(emb, hidden[:, k], state)
            if k < first:
                continue  # DFlash convention: slot 0 is the anchor; it only advances the rnn state
            if self.confidence_head is not None:
                conf.append(self.confidence_logits(hidden[:, k], emb))
            prev = self.to_vocab_ids(torch.argmax(logits[:, k] + bias, dim=-1))
            drafts.append(prev)
        return DraftProposal(ids=torch.stack(drafts, dim=1), confidence_logits=torch.stack(conf, dim=1) if conf else None)


EntryClass = DSparkDraftModel
