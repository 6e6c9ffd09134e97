"""LM-head projection: pick the rows that need logits, project, gather the vocabulary shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.cpu_gemm import linear
from sglite.srt.layers.dp_attention import run_over_all_groups
from sglite.srt.layers.utils import resolve_tp_group
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglite.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    """Logits and the hidden states behind them.

    ``next_token_logits``: fp32 ``[rows, vocab_size]``; one row per request (its last new token) for
    EXTEND/DECODE, one row per token for TARGET_VERIFY/DRAFT_BLOCK.
    ``hidden_states``: the final (normed) hidden states of the same rows.
    ``aux_hidden_states``: ``[T, k*hidden]`` for every new token, the outputs of the captured layers
    concatenated in the requested order (None when nothing was captured).
    """

    next_token_logits: torch.Tensor
    hidden_states: Optional[torch.Tensor] = None
    aux_hidden_states: Optional[torch.Tensor] = None
    extend_logits: Optional[torch.Tensor] = None  # [T, vocab] with ForwardBatch.return_extend_logits


def logprobs_with_top(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: Sequence[int]
) -> tuple[list[float], list[tuple[list[int], list[float]]]]:
    """Per row: log p(token) and the ``top_k[row]`` most likely (ids, logprobs), from the raw logits (vLLM's raw_logprobs).

    ``logits`` ``[rows, vocab]``, ``token_ids`` ``[rows]``; one log_softmax serves both.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.to(logprobs.device, torch.int64)[:, None])[:, 0].tolist()
    k_max = max(top_k, default=0)
    if k_max == 0:
        return chosen, [([], [])] * len(chosen)
    values, ids = logprobs.topk(k_max, dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return chosen, [(i[:k], v[:k]) for i, v, k in zip(ids_l, values_l, top_k)]


def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
    """Index of each request's last new token in the flattened [T] token axis."""
    return torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1


class LogitsProcessor(nn.Module):
    """Computes next-token logits from final hidden states with a vocab-parallel LM head."""

    def __init__(
        self,
        vocab_size: int,
        tp_group: Optional[GroupCoordinator] = None,
        dp_peer_group: Optional[GroupCoordinator] = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_group = resolve_tp_group(tp_group)
        # DP attention: the head is sharded over all of TP, so rows are exchanged with the other
        # attention-DP groups around the projection (layers/dp_attention.py).
        self.dp_peer_group = dp_peer_group

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: ParallelLMHead,
        forward_batch: ForwardBatch,
        aux_hidden_states: Optional[torch.Tensor] = None,
    ) -> LogitsProcessorOutput:
        """Select rows per the forward mode, project with ``lm_head``, gather shards, trim padding."""
        mode = forward_batch.forward_mode
        if mode.is_extend() and forward_batch.return_extend_logits:
            extend_logits = self.compute_logits(hidden_states, lm_head)
            last = last_token_indices(forward_batch)
            return LogitsProcessorOutput(
                next_token_logits=extend_logits[last], hidden_states=hidden_states[last],
                aux_hidden_states=aux_hidden_states, extend_logits=extend_logits,
            )
        if mode.returns_all_token_logits() or mode.is_decode() or mode.is_idle():
            pruned = hidden_states
        elif mode.is_extend():
            pruned = hidden_states[last_token_indices(forward_batch)]
        else:
            raise ValueError(f"LogitsProcessor: unhandled forward mode {mode!r}")
        logits = self.compute_logits(pruned, lm_head)
        return LogitsProcessorOutput(
            next_token_logits=logits, hidden_states=pruned, aux_hidden_states=aux_hidden_states
        )

    def compute_logits(self, hidden_states: torch.Tensor, lm_head: ParallelLMHead) -> torch.Tensor:
        """fp32 logits ``[rows, vocab_size]`` for arbitrary hidden-state rows (DFLASH drafts use this).

        Under DP attention every attention-DP group must call this the same number of times (an idle
        group passes zero rows).
        """

        def project(rows: torch.Tensor) -> torch.Tensor:
            logits = linear(rows.to(lm_head.weight.dtype), lm_head.weight, lm_head.bias, lm_head.packed_weight)
            if self.tp_group.world_size > 1:
                logits = self.tp_group.all_gather(logits, dim=-1)
            return logits[..., : self.vocab_size]

        return run_over_all_groups(project, hidden_states, self.dp_peer_group).float()
