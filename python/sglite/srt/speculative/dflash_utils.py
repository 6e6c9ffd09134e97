"""Verification of a DFLASH/DSPARK block: greedy longest-prefix accept and lossless sampling.

A block for one request is ``[c, d1 .. d_{B-1}]``: ``c`` is the last committed (bonus) token and
``d_j`` are the drafts. The target verifies the block causally; its output row ``j`` is the
distribution of the token at block position ``j + 1``. So draft ``d_j`` is judged by row ``j - 1``
and, after ``a`` accepted drafts, row ``a`` gives the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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


def sampling_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: Optional[torch.Tensor] = None,
    top_ks: Optional[torch.Tensor] = None,
    min_ps: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Target probabilities after temperature, top-k, top-p and min-p; logits [bs, n, V], params [bs]."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [bs, n, V], got {tuple(logits.shape)}")
    if bool((temperatures <= 0).any()):
        raise ValueError("sampling_probs needs temperature > 0; greedy requests use greedy_verify")
    scores = logits.float() / temperatures.float()[:, None, None]
    vocab = scores.shape[-1]
    if top_ks is not None:
        # -1 (or any value <= 0) means no top-k, as in SamplingParams.
        k = torch.where(top_ks <= 0, torch.full_like(top_ks, vocab), top_ks).clamp(max=vocab).to(torch.int64)
        sorted_scores, _ = scores.sort(dim=-1, descending=True)
        kth = sorted_scores.gather(-1, (k - 1)[:, None, None].expand(-1, scores.shape[1], 1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_ps is not None and bool((top_ps < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_ps.float()[:, None, None]
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if min_ps is not None and bool((min_ps > 0).any()):
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps.float()[:, None, None]
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


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
