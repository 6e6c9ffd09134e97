"""Guard for token-for-token greedy comparisons: the reference's choice at every step must be clear.

Two fp32 implementations (ours and transformers, or one model at two batch shapes) agree only to
rounding, and how they round depends on the CPU (ISA of the vectorised kernels, BLAS code path,
thread count). Where the reference's top-1 and top-2 logits are closer than that disagreement, the
greedy token is a coin toss that passes on one machine and fails on another. If every step's margin
exceeds ``2 * atol`` and both sides' logits agree to ``atol`` elementwise, no rounding can flip the
argmax, so exact token equality is a sound check on any CPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# Twice the 1e-4 logits tolerance (floor) the models-vs-transformers tests assert: with both sides within
# 1e-4 of each other, a margin above this cannot be overturned. (Observed gaps are ~1e-5.)
MIN_GREEDY_MARGIN = 2e-4


@torch.no_grad()
def greedy_margins(
    hf_model: Any, prompt: Sequence[int], continuation: Sequence[int], banned_ids: Sequence[int] = ()
) -> torch.Tensor:
    """Top-1 minus top-2 reference logit at each step of ``continuation``, teacher-forced in one forward.

    ``banned_ids`` are tokens the reference run could not emit (e.g. EOS under ``min_new_tokens``).
    Also checks that each continuation token is the reference's argmax (within the margin guard's
    tolerance), so a continuation that is not the reference's greedy output is reported here.
    """
    if not continuation:
        return torch.empty(0)
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(prompt) + list(continuation)[:-1]], device=device)
    logits = hf_model(ids).logits[0, len(prompt) - 1 :].float()
    if banned_ids:
        logits[:, list(banned_ids)] = float("-inf")
    top2 = logits.topk(2, dim=-1)
    chosen = logits.gather(-1, torch.tensor(list(continuation), device=device)[:, None])[:, 0]
    behind = top2.values[:, 0] - chosen
    bad = (behind > MIN_GREEDY_MARGIN).nonzero()
    if bad.numel():
        step = int(bad[0, 0])
        raise AssertionError(
            f"continuation token {continuation[step]} at step {step} is {float(behind[step]):.3g} below the "
            f"reference's top logit (token {int(top2.indices[step, 0])}): not the reference's greedy output"
        )
    return (top2.values[:, 0] - top2.values[:, 1]).cpu()


def assert_clear_greedy_margins(
    hf_model: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    min_margin: float = MIN_GREEDY_MARGIN,
    banned_ids: Sequence[int] = (),
) -> None:
    """Every step of every reference greedy continuation has a top-1/top-2 logit margin >= ``min_margin``.

    Call it on the reference output before comparing tokens exactly; a failure names the prompt and
    step whose near-tie would make the comparison depend on the CPU (pick another prompt or seed).
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        margins = greedy_margins(hf_model, prompt, cont, banned_ids)
        if margins.numel() and float(margins.min()) < min_margin:
            step = int(margins.argmin())
            raise AssertionError(
                f"prompt {i}: the reference's top-1/top-2 logit margin at step {step} is "
                f"{float(margins[step]):.3g} < {min_margin:g}, a near-tie that CPU rounding can flip; "
                "choose another prompt or seed for this token-for-token comparison"
            )
