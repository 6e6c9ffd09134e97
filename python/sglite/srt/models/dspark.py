"""DSPARK draft: the DFLASH backbone plus a low-rank Markov head and an optional confidence head.

Markov head ("vanilla"): a logit bias from the previous token, ``bias(prev) = markov_w2 @ markov_w1[prev]``
(``markov_w1 [V, r]`` embeds the previous token, ``markov_w2 [V, r]`` projects it to the vocabulary).
Drafts are taken left to right inside the block: slot j's logits are the target LM head over the
backbone's row j plus ``bias(token at slot j-1)``, so each draft conditions on the one before it
(slot 1 conditions on the anchor). Config: top-level ``mask_token_id``, ``target_layer_ids``,
``block_size``, ``markov_rank`` (the public DSPARK format; ``ModelConfig.draft`` resolves them).
The confidence head (``enable_confidence_head``) scores each draft slot; sglite verifies every block
in full (SGLang's ``static`` mode), so the scores are computed on request only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.layers.logits_processor import LogitsProcessorOutput
from sglite.srt.model_executor.forward_batch_info import ForwardBatch
from sglite.srt.models.dflash import DFlashDraftModel

SUPPORTED_MARKOV_HEADS = ("vanilla",)


class DSparkDraftModel(DFlashDraftModel):
    """DFLASH backbone + previous-token Markov logit bias, drafted left to right within the block."""

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(config, params_dtype)
        spec = config.draft
        if spec.algorithm != "DSPARK":
            raise ValueError(f"{config.path or 'draft'}: not a DSPARK config (architectures {config.architectures})")
        if spec.markov_head_type not in SUPPORTED_MARKOV_HEADS:
            raise ValueError(
                f"DSPARK markov_head_type {spec.markov_head_type!r} is not supported (supported: "
                f"{list(SUPPORTED_MARKOV_HEADS)}); use a vanilla-head checkpoint"
            )
        dtype = params_dtype or torch.get_default_dtype()
        vocab, rank = config.vocab_size, spec.markov_rank
        self.markov_rank = rank
        # markov_w1: previous-token embedding [V, r]; markov_w2: projection to a vocab bias, weight [V, r].
        self.markov_w1 = nn.Embedding(vocab, rank, dtype=dtype)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False, dtype=dtype)
        self.markov_w1.weight.requires_grad_(False)
        self.markov_w2.weight.requires_grad_(False)
        self.confidence_with_markov = bool(config.hf_config.get("confidence_head_with_markov", False))
        if spec.enable_confidence_head:
            width = config.hidden_size + (rank if self.confidence_with_markov else 0)
            self.confidence_head = nn.Linear(width, 1, bias=False, dtype=dtype)
            self.confidence_head.weight.requires_grad_(False)
        else:
            self.confidence_head = None

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """fp32 logit bias [n, V] given the previous token of each row."""
        return self.markov_w2(self.markov_w1(prev_ids)).float()

    def propose_drafts(self, out: LogitsProcessorOutput, forward_batch: ForwardBatch, block_size: int) -> torch.Tensor:
        """Drafts [bs, B-1], left to right: argmax(target-head logits of row j + bias(token j-1))."""
        bs = forward_batch.batch_size
        logits = out.next_token_logits.reshape(bs, block_size, -1)
        prev = forward_batch.input_ids.reshape(bs, block_size)[:, 0]
        drafts = []
        for j in range(1, block_size):
            prev = torch.argmax(logits[:, j] + self.markov_bias(prev), dim=-1)
            drafts.append(prev)
        return torch.stack(drafts, dim=1)

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Per-slot acceptance confidence in (0, 1) from the optional confidence head."""
        if self.confidence_head is None:
            raise ValueError("this DSPARK checkpoint has no confidence head (enable_confidence_head is false)")
        x = hidden
        if self.confidence_with_markov:
            x = torch.cat([hidden, self.markov_w1(prev_ids).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head(x).float())[..., 0]


EntryClass = DSparkDraftModel
