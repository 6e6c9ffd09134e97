"""SamplingBatchInfo: the per-row sampling parameters of one batch, as tensors the sampler reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from sglite.srt.sampling.penaltylib import LogitsPenalties, TokenHistory
from sglite.srt.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    """Row i holds request i's temperature, top-p, top-k, min-p and (optional) seed.

    ``seed_offsets[i]`` is mixed into row i's seed (callers pass the request's number of generated
    tokens) so a seeded request draws fresh noise at every step yet reproduces exactly on a rerun,
    whatever else shares its batch.
    """

    temperatures: torch.Tensor  # [bs, 1] fp32; 1.0 for greedy rows (never divided by 0)
    top_ps: torch.Tensor  # [bs] fp32
    top_ks: torch.Tensor  # [bs] int64, vocab_size when disabled
    min_ps: torch.Tensor  # [bs] fp32
    is_greedy: torch.Tensor  # [bs] bool
    seeds: list[Optional[int]]
    seed_offsets: list[int]
    vocab_size: int
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # Penalties / logit_bias / min_new_tokens, applied to the logits before anything else; None when no
    # row asks for them.
    penalties: Optional[LogitsPenalties] = None

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return len(self.seeds)

    @classmethod
    def from_sampling_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: Union[str, torch.device] = "cpu",
        seed_offsets: Optional[Sequence[int]] = None,
        histories: Optional[Sequence[TokenHistory]] = None,
    ) -> "SamplingBatchInfo":
        """Build from one SamplingParams per row; seeded rows need ``seed_offsets``, penalized rows ``histories``."""
        if not params:
            raise ValueError("SamplingBatchInfo needs at least one row")
        penalties = None
        if any(p.needs_logits_processing for p in params):
            if histories is None:
                raise ValueError("penalties, logit_bias and min_new_tokens need each row's token history")
            penalties = LogitsPenalties.build(params, histories, vocab_size, device)
        seeds = [p.seed for p in params]
        if any(s is not None for s in seeds) and seed_offsets is None:
            raise ValueError(
                "seeded sampling needs seed_offsets (e.g. each request's generated-token count) so that "
                "every step draws different noise"
            )
        offsets = [0] * len(params) if seed_offsets is None else [int(o) for o in seed_offsets]
        if len(offsets) != len(params):
            raise ValueError(f"seed_offsets has {len(offsets)} entries for {len(params)} rows")
        greedy = [p.is_greedy for p in params]
        top_ks = [min(p.normalized_top_k(), vocab_size) for p in params]
        return cls(
            temperatures=torch.tensor(
                [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)], dtype=torch.float32, device=device
            ).unsqueeze(1),
            top_ps=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            seeds=seeds,
            seed_offsets=offsets,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy) if not g),
            need_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            need_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
            penalties=penalties,
        )

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits after penalties, bias and min_new_tokens (the input itself when no row has any)."""
        return logits if self.penalties is None else self.penalties.apply(logits)

    def repeat_interleave(self, repeats: int, block_ids: Optional[torch.Tensor] = None) -> "SamplingBatchInfo":
        """Each row repeated ``repeats`` times (one row per token of a verify block); offsets count up.

        With penalties, ``block_ids`` (the ``[bs, repeats]`` verify block) advances each copy's token
        history by the drafts before it (``LogitsPenalties.for_block``).
        """
        if self.penalties is not None and block_ids is None:
            raise ValueError("repeating a penalized batch needs the verify block's token ids")
        idx = torch.arange(self.batch_size, device=self.top_ps.device).repeat_interleave(repeats)
        return SamplingBatchInfo(
            temperatures=self.temperatures[idx],
            top_ps=self.top_ps[idx],
            top_ks=self.top_ks[idx],
            min_ps=self.min_ps[idx],
            is_greedy=self.is_greedy[idx],
            seeds=[s for s in self.seeds for _ in range(repeats)],
            seed_offsets=[o + j for o in self.seed_offsets for j in range(repeats)],
            vocab_size=self.vocab_size,
            all_greedy=self.all_greedy,
            need_top_p=self.need_top_p,
            need_top_k=self.need_top_k,
            need_min_p=self.need_min_p,
            penalties=None if self.penalties is None else self.penalties.for_block(block_ids),
        )
