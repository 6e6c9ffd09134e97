"""Expert routing: router logits → (weights, expert ids) per token.

One function covers the routers of the served families:
- softmax scores, top-k, optional renormalisation (Qwen3-MoE's ``norm_topk_prob``);
- sigmoid scores with a per-expert correction bias used only to *choose* experts, grouped top-k
  (keep the ``topk_group`` best of ``num_expert_group`` groups, each scored by its two best experts),
  renormalisation and ``routed_scaling_factor`` (DeepSeek-V3 / Kimi-K2's ``noaux_tc``).

Weights are fp32; ids are int64 global expert ids in ``[0, num_experts)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class TopKConfig:
    """How one MoE layer routes its tokens."""

    top_k: int
    scoring_func: str = "softmax"
    renormalize: bool = True
    num_expert_group: Optional[int] = None  # grouped top-k when set (with topk_group)
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"MoE scoring_func {self.scoring_func!r} is not one of {list(SCORING_FUNCS)}")
        if self.top_k < 1:
            raise ValueError(f"MoE top_k must be >= 1, got {self.top_k}")
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError("grouped MoE routing needs both n_group and topk_group")


def select_experts(
    router_logits: torch.Tensor, config: TopKConfig, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` ``[T, E]`` → (fp32 weights ``[T, k]``, int64 expert ids ``[T, k]``)."""
    logits = router_logits.float()
    if config.scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_expert_group is not None and config.num_expert_group > 1:
        choice = _mask_to_best_groups(choice, config.num_expert_group, int(config.topk_group))
    ids = torch.topk(choice, k=config.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if config.renormalize:
        # The small epsilon keeps a row of all-zero sigmoid weights finite (the DeepSeek reference has it).
        eps = 1e-20 if config.scoring_func == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids


def _mask_to_best_groups(choice: torch.Tensor, num_groups: int, topk_group: int) -> torch.Tensor:
    """Scores outside the ``topk_group`` best expert groups set to -inf; a group scores its two best experts."""
    t, e = choice.shape
    if e % num_groups != 0:
        raise ValueError(f"{e} experts cannot be split into n_group={num_groups} equal groups")
    grouped = choice.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(min(2, e // num_groups), dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
