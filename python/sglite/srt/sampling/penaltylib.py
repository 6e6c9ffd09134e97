"""Logits processing before sampling: repetition, frequency and presence penalties, logit_bias, min_new_tokens.

Formulas (SGLang's and vLLM's; OpenAI's for frequency / presence):
- repetition (HF's ``RepetitionPenaltyLogitsProcessor``), over the prompt and the generated tokens:
  ``l = l / r`` where ``l > 0`` else ``l * r``;
- frequency and presence, over the generated tokens only: ``l -= f * count + p * (count > 0)``;
- logit_bias: ``l += bias[token]``;
- min_new_tokens: EOS and the stop token ids get ``-inf`` while fewer tokens than that were generated.
They apply in that order (vLLM's: the multiplicative penalty sees the model's own logits). A row whose
parameters are neutral (r = 1, f = p = 0, no bias, no minimum) comes out bit-identical.

A speculative verify block scores B positions at once; ``for_block`` gives position j the state after
the block's first j drafts were accepted, so every verify row is the distribution plain decoding would
have used at that position and the verify stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Sequence, Union

import torch

from sglite.srt.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """What a request's penalties look at: its prompt, its generated tokens and the ids that end it."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_token_ids: Collection[int] = ()


@dataclass
class LogitsPenalties:
    """Per-row penalty state of a batch (one row per logits row)."""

    output_counts: torch.Tensor  # [rows, V] fp32: times each token was generated
    seen: torch.Tensor  # [rows, V] bool: token in the prompt or the output
    generated: torch.Tensor  # [rows] int64: tokens generated before the row's token
    frequency: torch.Tensor  # [rows, 1] fp32
    presence: torch.Tensor  # [rows, 1] fp32
    repetition: torch.Tensor  # [rows, 1] fp32
    min_new_tokens: torch.Tensor  # [rows] int64
    min_tokens_stop: torch.Tensor  # [rows, V] bool: ids masked while generated < min_new_tokens
    logit_bias: Optional[torch.Tensor]  # [rows, V] fp32, None when no row has a bias

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory],
        vocab_size: int,
        device: Union[str, torch.device] = "cpu",
    ) -> "LogitsPenalties":
        """The state of each row from its request's parameters and token history."""
        if len(params) != len(histories):
            raise ValueError(f"{len(histories)} token histories for {len(params)} rows")
        bs = len(params)
        counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
        seen = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
        stop = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
        bias = None
        for i, (p, h) in enumerate(zip(params, histories)):
            out = torch.tensor(list(h.output_ids), dtype=torch.int64, device=device)
            if out.numel():
                counts[i].index_add_(0, out, torch.ones(out.numel(), dtype=torch.float32, device=device))
            if p.repetition_penalty != 1.0:
                seen[i, torch.tensor(list(h.prompt_ids), dtype=torch.int64, device=device)] = True
                seen[i] |= counts[i] > 0
            if p.min_new_tokens > 0:
                ids = [t for t in (*h.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size]
                stop[i, torch.tensor(ids, dtype=torch.int64, device=device)] = True
            if p.logit_bias:
                if bias is None:
                    bias = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
                ids = torch.tensor([int(k) for k in p.logit_bias], dtype=torch.int64, device=device)
                bias[i, ids] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        return cls(
            output_counts=counts,
            seen=seen,
            generated=torch.tensor([len(h.output_ids) for h in histories], dtype=torch.int64, device=device),
            frequency=column([float(p.frequency_penalty) for p in params]),
            presence=column([float(p.presence_penalty) for p in params]),
            repetition=column([float(p.repetition_penalty) for p in params]),
            min_new_tokens=torch.tensor([p.min_new_tokens for p in params], dtype=torch.int64, device=device),
            min_tokens_stop=stop,
            logit_bias=bias,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 processed logits ``[rows, V]`` (a new tensor; the input is not modified)."""
        if logits.shape != self.output_counts.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match the penalty state {tuple(self.output_counts.shape)}")
        out = logits.float()
        penalized = torch.where(out > 0, out / self.repetition, out * self.repetition)
        out = torch.where(self.seen, penalized, out)
        out = out - self.frequency * self.output_counts - self.presence * (self.output_counts > 0).float()
        if self.logit_bias is not None:
            out = out + self.logit_bias
        mask = self.min_tokens_stop & (self.generated < self.min_new_tokens)[:, None]
        # A row whose stop ids cover the whole vocabulary keeps them: an all -inf row has no distribution.
        mask &= ~mask.all(dim=-1, keepdim=True)
        return out.masked_fill(mask, float("-inf"))

    def for_block(self, block_ids: torch.Tensor) -> "LogitsPenalties":
        """Rows ``i * B + j`` for a verify block ``[c, d1 .. d_{B-1}]``: request i after d1..dj were generated."""
        bs, block = block_ids.shape
        if bs != self.output_counts.shape[0]:
            raise ValueError(f"block of {bs} requests for a penalty state of {self.output_counts.shape[0]} rows")
        idx = torch.arange(bs, device=block_ids.device).repeat_interleave(block)
        counts = self.output_counts[idx].clone()
        # Row (i, j) counts drafts k = 1..j: every (j, k) with 1 <= k <= j.
        j, k = torch.tril_indices(block, block, device=block_ids.device)
        keep = k >= 1
        j, k = j[keep], k[keep]
        rows = (torch.arange(bs, device=block_ids.device)[:, None] * block + j[None, :]).reshape(-1)
        cols = block_ids[:, k].reshape(-1).to(torch.int64)
        counts.index_put_((rows, cols), torch.ones(rows.numel(), dtype=counts.dtype, device=counts.device), accumulate=True)
        offsets = torch.arange(block, device=block_ids.device).repeat(bs)
        return LogitsPenalties(
            output_counts=counts,
            seen=self.seen[idx] | (counts > 0),
            generated=self.generated[idx] + offsets,
            frequency=self.frequency[idx],
            presence=self.presence[idx],
            repetition=self.repetition[idx],
            min_new_tokens=self.min_new_tokens[idx],
            min_tokens_stop=self.min_tokens_stop[idx],
            logit_bias=None if self.logit_bias is None else self.logit_bias[idx],
        )
