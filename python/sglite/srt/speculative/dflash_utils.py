"""Verification of a DFLASH/DSPARK block: greedy longest-prefix accept and lossless sampling.

A block for one request is ``[c, d1 .. d_{B-1}]``: ``c`` is the last committed (bonus) token and
``d_j`` are the drafts. The target verifies the block causally; its output row ``j`` is the
distribution of the token at block position ``j + 1``. So draft ``d_j`` is judged by row ``j - 1``
and, after ``a`` accepted drafts, row ``a`` gives the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from sglite.srt.layers.sampler import Sampler
    from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class BlockVerifyResult:
    """Per-request outcome of verifying one block."""

    accept_lens: torch.Tensor  # [bs] number of drafts accepted (0 .. B-1)
    bonus_ids: torch.Tensor  # [bs] the token the target adds after the accepted drafts


def greedy_verify(block_ids: torch.Tensor, target_argmax: torch.Tensor) -> BlockVerifyResult:
    """Accept the longest prefix of drafts equal to the target's argmax, then its next argmax as bonus."""
    if block_ids.shape != target_argmax.shape or block_ids.dim() != 2:
        raise ValueError(f"block_ids {tuple(block_ids.shape)} and target_argmax {tuple(target_argmax.shape)} must be equal [bs, B]")
    matches = (block_ids[:, 1:] == target_argmax[:, :-1]).to(torch.int64)
    accept_lens = matches.cumprod(dim=1).sum(dim=1)
    bonus_ids = target_argmax.gather(1, accept_lens[:, None])[:, 0]
    return BlockVerifyResult(accept_lens=accept_lens, bonus_ids=bonus_ids)


def verify_probs(logits: torch.Tensor, info: "SamplingBatchInfo", sampler: "Sampler") -> torch.Tensor:
    """Target probabilities [rows, V] of verify rows, filtered exactly as the sampler filters (top-k/p, min-p).

    ``logits`` are already processed (``SamplingBatchInfo.process_logits``: penalties, bias, min tokens).

    ``info`` has one row per logits row (``SamplingBatchInfo.repeat_interleave(B)`` of the batch), so
    speculative and plain sampling draw from the same distribution.
    """
    probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
    sorted_probs, order = sampler.filtered_probs(probs, info)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sampling_verify(
    block_ids: torch.Tensor,
    target_probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> BlockVerifyResult:
    """Lossless verification of deterministic drafts against target probabilities [bs, B, V].

    Draft ``d_j`` is accepted with probability ``p_{j-1}(d_j)``. On the first rejection the bonus is
    drawn from ``p_{j-1}`` with ``d_j``'s mass removed and renormalised (the residual of ``p`` minus
    a point mass draft); when every draft is accepted it is drawn from the last row. The committed
    tokens are then distributed exactly as target sampling one token at a time.
    """
    bs, block = block_ids.shape
    if target_probs.shape[:2] != (bs, block):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} does not match block_ids {tuple(block_ids.shape)}")
    drafts = block_ids[:, 1:]
    p_draft = target_probs[:, :-1].gather(-1, drafts[..., None])[..., 0]  # [bs, B-1]
    uniform = torch.rand(p_draft.shape, generator=generator, device=p_draft.device, dtype=p_draft.dtype)
    accepted = (uniform < p_draft).to(torch.int64)
    accept_lens = accepted.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(bs, device=block_ids.device)
    bonus_probs = target_probs[rows, accept_lens].clone()  # [bs, V]
    rejected = accept_lens < block - 1
    if bool(rejected.any()):
        rejected_rows = rows[rejected]
        rejected_tokens = drafts[rejected_rows, accept_lens[rejected]]
        bonus_probs[rejected_rows, rejected_tokens] = 0.0
        totals = bonus_probs[rejected_rows].sum(dim=-1, keepdim=True)
        if bool((totals <= 0).any()):
            raise RuntimeError("sampling_verify: a rejected draft held all target mass; target probs are inconsistent")
        bonus_probs[rejected_rows] = bonus_probs[rejected_rows] / totals
    bonus_ids = torch.multinomial(bonus_probs, 1, generator=generator)[:, 0]
    return BlockVerifyResult(accept_lens=accept_lens, bonus_ids=bonus_ids)


def committed_tokens(block_ids: torch.Tensor, result: BlockVerifyResult) -> list[list[int]]:
    """New output tokens per request: the accepted drafts then the bonus (1 .. B tokens)."""
    out = []
    for i, n in enumerate(result.accept_lens.tolist()):
        out.append(block_ids[i, 1 : 1 + n].tolist() + [int(result.bonus_ids[i])])
    return out
