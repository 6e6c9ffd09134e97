"""FusedMoE: the routed experts of one MoE layer, sharded over the TP group by expert and by width.

Sharding (SGLang's split without a dedicated all-to-all): the TP group of ``tp_size`` ranks is
``ep_size`` expert groups of ``tp_size / ep_size`` ranks. Expert-parallel rank ``r // moe_tp_size``
holds experts ``[E/ep * ep_rank, E/ep * (ep_rank + 1))``; inside it each expert's intermediate width is
split over ``moe_tp_size`` ranks. Every rank sees every token (the attention output is already
all-reduced), computes its experts' partial sums, and one all-reduce over the TP group combines them:
dispatch is the replicated input, combine is the reduction.

Checkpoint tensors arrive per expert (``experts.{e}.gate_proj / up_proj / down_proj``) through
``expert_params_mapping``; tensors of experts held by other ranks are skipped.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.moe.fused_moe_native import fused_moe_native
from sglite.srt.layers.moe.topk import TopKConfig, select_experts
from sglite.srt.layers.utils import check_full_shape

# checkpoint projection -> (fused parameter, part)
_EXPERT_PARTS = (("gate_proj", "w13_weight", "w1"), ("up_proj", "w13_weight", "w3"), ("down_proj", "w2_weight", "w2"))


def expert_params_mapping(num_experts: int, prefix: str = ".experts.") -> list[tuple[str, str, Any]]:
    """``stacked_params_mapping`` rows routing ``experts.{e}.{gate,up,down}_proj.weight`` into the fused tensors.

    They must come before a model's ``.gate_proj`` → ``.gate_up_proj`` rows (the first matching row wins).
    """
    return [
        (f"{prefix}{e}.{proj}.weight", f"{prefix}{param}", (e, part))
        for e in range(num_experts)
        for proj, param, part in _EXPERT_PARTS
    ]


def check_moe_sharding(num_experts: int, intermediate_size: int, tp_size: int, ep_size: int) -> tuple[int, int]:
    """(experts per rank, intermediate width per rank) at this TP / EP split; a split that does not divide is
    the one clear error the layer and ``sglite plan`` both raise."""
    if ep_size < 1 or tp_size % ep_size != 0:
        raise ValueError(f"--ep-size {ep_size} must divide the MoE layer's TP width {tp_size}")
    if num_experts % ep_size != 0:
        raise ValueError(f"--ep-size {ep_size} must divide the model's {num_experts} routed experts")
    moe_tp_size = tp_size // ep_size
    if intermediate_size % moe_tp_size != 0:
        raise ValueError(
            f"moe_intermediate_size {intermediate_size} is not divisible by the per-expert TP width "
            f"{moe_tp_size} (--tp-size / --ep-size); raise --ep-size or lower --tp-size"
        )
    return num_experts // ep_size, intermediate_size // moe_tp_size


class FusedMoE(nn.Module):
    """Routed experts: ``forward(hidden, router_logits)`` → the weighted expert sum, reduced over ``tp_group``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        topk: TopKConfig,
        tp_group: GroupCoordinator,
        ep_size: int = 1,
        activation: str = "silu",
        reduce_results: bool = True,
        params_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        tp_size, tp_rank = tp_group.world_size, tp_group.rank_in_group
        self.num_local_experts, self.intermediate_per_partition = check_moe_sharding(
            num_experts, intermediate_size, tp_size, ep_size
        )
        self.ep_size = ep_size
        self.moe_tp_size = tp_size // ep_size
        self.ep_rank, self.moe_tp_rank = divmod(tp_rank, self.moe_tp_size)
        self.num_experts = num_experts
        self.first_local_expert = self.ep_rank * self.num_local_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.topk = topk
        self.activation = activation
        self.reduce_results = reduce_results
        dtype = params_dtype or torch.get_default_dtype()
        i, h, e = self.intermediate_per_partition, hidden_size, self.num_local_experts
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # The expert computation for the device the weights live on, chosen once (not on every step).
        self.experts_fn = fused_moe_native
        if self.w13_weight.is_cuda:  # the Triton grouped GEMMs, checked against the native path on CPU
            from sglite.srt.layers.moe.fused_moe_triton import fused_moe_triton

            self.experts_fn = fused_moe_triton

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Copy this rank's slice of one expert's gate / up / down matrix (other ranks' experts are skipped)."""
        expert, part = shard_id
        local = expert - self.first_local_expert
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert {expert} is outside the model's {self.num_experts} experts")
        i, rank = self.intermediate_per_partition, self.moe_tp_rank
        if part == "w2":
            check_full_shape(loaded, (self.hidden_size, self.intermediate_size), f"expert {expert} down_proj")
            if 0 <= local < self.num_local_experts:
                param.data[local].copy_(loaded.narrow(1, rank * i, i))
            return
        check_full_shape(loaded, (self.intermediate_size, self.hidden_size), f"expert {expert} {part} projection")
        if 0 <= local < self.num_local_experts:
            rows = slice(0, i) if part == "w1" else slice(i, 2 * i)
            param.data[local, rows].copy_(loaded.narrow(0, rank * i, i))

    def forward(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Route, run this rank's experts, and (with ``reduce_results``) sum the partials over the TP group."""
        weights, ids = select_experts(router_logits, self.topk, correction_bias)
        out = self.experts_fn(
            hidden_states, self.w13_weight, self.w2_weight, weights, ids,
            first_local_expert=self.first_local_expert, activation=self.activation,
        )
        if self.reduce_results and self.tp_group.world_size > 1:
            out = self.tp_group.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_local_experts}/{self.num_experts} (ep {self.ep_rank}/{self.ep_size}), "
            f"hidden={self.hidden_size}, intermediate={self.intermediate_per_partition}/{self.intermediate_size}, "
            f"top_k={self.topk.top_k}, scoring={self.topk.scoring_func}"
        )
