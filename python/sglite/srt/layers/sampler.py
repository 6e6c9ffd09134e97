"""Token sampling: greedy, temperature, top-k, top-p and min-p, with per-request seeds.

Penalties, logit_bias and min_new_tokens (``SamplingBatchInfo.process_logits``) change the logits first.

Filtering follows the joint rule of SGLang's torch reference: on probabilities sorted in descending
order, drop ranks >= top_k, drop tokens whose preceding cumulative mass already exceeds top_p, drop
tokens below ``min_p * max_prob``. Sampling uses the exponential race (argmax of p / E with
E ~ Exp(1)), which draws exactly from p and lets each seeded row use its own generator.
"""

from __future__ import annotations

import torch
from torch import nn

from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, offset) pairs apart
_MASK63 = (1 << 63) - 1


def mixed_seed(seed: int, offset: int) -> int:
    """Deterministic generator seed for request seed ``seed`` at step ``offset``."""
    return ((seed & _MASK63) * 1_000_003 + (offset + 1) * _SEED_MIX) & _MASK63


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first one on ties, as ``torch.argmax``).

    ``max(dim).indices`` gives the same indices and runs 2.5-3x faster than ``argmax`` on CPU
    (4096-wide rows: bs 32 in 71 us instead of 201 us).
    """
    return x.max(dim=-1).indices


class Sampler(nn.Module):
    """Samples one token id per logits row according to a SamplingBatchInfo."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        # Unseeded rows draw from this generator; seeding it makes a whole run reproducible.
        self._generators: dict[str, torch.Generator] = {}
        self._scratch_generators: dict[str, torch.Generator] = {}
        self._seed = seed

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[key]

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """int64 token ids ``[bs]`` for fp32 logits ``[bs, vocab]``."""
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {info.batch_size} rows")
        logits = info.process_logits(logits)
        greedy_ids = row_argmax(logits)
        if info.all_greedy:
            return greedy_ids
        probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
        sampled = self.sample_from_probs(probs, info)
        return torch.where(info.is_greedy, greedy_ids, sampled)

    def filtered_probs(self, probs: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities sorted descending with filtered entries zeroed, the sort's token ids)."""
        probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
        if info.need_top_k:
            ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            probs_sort = probs_sort.masked_fill(ranks >= info.top_ks[:, None], 0.0)
        if info.need_top_p:
            mass_before = torch.cumsum(probs_sort, dim=-1) - probs_sort
            # Rows with top_p == 1 filter nothing: a float cumsum over a large vocab overshoots 1.0.
            drop = (mass_before > info.top_ps[:, None]) & (info.top_ps[:, None] < 1.0)
            probs_sort = probs_sort.masked_fill(drop, 0.0)
        if info.need_min_p:
            threshold = probs_sort[:, :1] * info.min_ps[:, None]
            probs_sort = probs_sort.masked_fill(probs_sort < threshold, 0.0)
        return probs_sort, probs_idx

    def sample_from_probs(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """One filtered sample per row (seeded rows use their own generator).

        Rows without top-k / top-p / min-p race over the vocabulary in token order, so a batch that needs
        no filtering never sorts the vocabulary; rows that filter race over their sorted, filtered
        probabilities. Which order a row uses depends only on its own parameters, so a seeded row draws
        the same token whatever shares its batch.
        """
        noise = self._exponential_noise(probs.shape, info, probs.device)
        if not (info.need_top_k or info.need_top_p or info.need_min_p):
            return row_argmax(probs / noise)
        probs_sort, probs_idx = self.filtered_probs(probs, info)
        choice = row_argmax(probs_sort / noise)[:, None]
        filtered = torch.gather(probs_idx, 1, choice).squeeze(1)
        unfiltered_rows = (info.top_ks >= probs.shape[-1]) & (info.top_ps >= 1.0) & (info.min_ps <= 0.0)
        return torch.where(unfiltered_rows, row_argmax(probs / noise), filtered)

    def _exponential_noise(
        self, shape: torch.Size, info: SamplingBatchInfo, device: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        noise.exponential_(generator=self._generator(device))
        seeded = [(row, seed, offset) for row, (seed, offset) in enumerate(zip(info.seeds, info.seed_offsets)) if seed is not None]
        if seeded:
            # One scratch generator re-seeded per row (same stream as a fresh one, without building one per row).
            gen = self._scratch_generator(device)
            for row, seed, offset in seeded:
                gen.manual_seed(mixed_seed(seed, offset))
                noise[row].exponential_(generator=gen)
        # Exp(1) draws are > 0 almost surely; guard the measure-zero 0 so p / E stays finite.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _scratch_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._scratch_generators:
            self._scratch_generators[key] = torch.Generator(device=device)
        return self._scratch_generators[key]
