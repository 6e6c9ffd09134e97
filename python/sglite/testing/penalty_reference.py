"""Reference for penalties / logit_bias / min_new_tokens: transformers' own logits processors on
transformers' logits (frequency and presence by OpenAI's formula, which transformers does not ship)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sglite.testing.greedy_margin import MIN_GREEDY_MARGIN


def processed_reference_logits(
    logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], params: Any, eos_ids: Sequence[int] = ()
) -> torch.Tensor:
    """One ``[V]`` logits row after repetition (HF), frequency/presence, bias (HF) and min length (HF)."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    ids = torch.tensor([list(prompt) + list(output)], device=logits.device)
    x = logits.float()[None].clone()
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    counts = torch.zeros(x.shape[-1], device=x.device)
    if output:
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.int64), minlength=x.shape[-1]).float().to(x.device)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        x = SequenceBiasLogitsProcessor({(int(k),): float(v) for k, v in params.logit_bias.items()})(ids, x)
    if params.min_new_tokens:
        stop = [*eos_ids, *params.stop_token_ids]
        x = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_new_tokens, stop)(ids, x)
    return x[0]


@torch.no_grad()
def hf_processed_greedy(
    hf_model: Any, prompt: Sequence[int], params: Any, eos_ids: Sequence[int] = (), min_margin: float = MIN_GREEDY_MARGIN
) -> list[int]:
    """Greedy tokens of ``hf_model`` under ``params``' penalties, stopping as the server does (EOS / stop ids).

    Every step's processed top-1 must lead its runner-up by ``min_margin``, so exact comparisons are safe.
    """
    out: list[int] = []
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    for _ in range(params.max_new_tokens):
        logits = hf_model(torch.tensor([list(prompt) + out])).logits[0, -1]
        x = processed_reference_logits(logits, prompt, out, params, eos_ids)
        top2 = x.topk(2)
        margin = float(top2.values[0] - top2.values[1])
        if margin < min_margin:
            raise AssertionError(f"near-tie at step {len(out)} (margin {margin:.3g}); pick other test inputs")
        out.append(int(top2.indices[0]))
        if out[-1] in stops:
            break
    return out
