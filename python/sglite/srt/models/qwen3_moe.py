"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): the Qwen3 decoder with routed-expert MLPs.

Layer ``i`` is sparse unless it is in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th
layer is (``(i + 1) % step == 0``); dense layers keep the gated MLP of ``intermediate_size``. The
router is a softmax over ``num_experts`` logits, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob`` is set; there is no shared expert.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.linear import ReplicatedLinear
from sglite.srt.layers.moe.layer import FusedMoE, expert_params_mapping
from sglite.srt.layers.moe.topk import TopKConfig
from sglite.srt.models.llama import LlamaForCausalLM
from sglite.srt.runtime_context import get_parallel


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) plus the routed experts (``experts``, TP/EP-sharded)."""

    def __init__(self, config: ModelConfig, mlp_group: GroupCoordinator) -> None:
        super().__init__()
        moe = config.moe
        hf = config.hf_config.get("text_config") or config.hf_config
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=moe.num_experts,
            hidden_size=config.hidden_size,
            intermediate_size=moe.moe_intermediate_size,
            topk=TopKConfig(top_k=moe.top_k, renormalize=bool(hf.get("norm_topk_prob", True))),
            tp_group=mlp_group,
            ep_size=get_parallel().ep_size,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Route each token and sum its experts' outputs."""
        return self.experts.forward(hidden_states, self.gate.forward(hidden_states))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 attention (q/k norm, no bias) with sparse MoE blocks."""

    qkv_bias_default = False
    qk_norm = True

    def __init__(self, config: ModelConfig) -> None:
        if config.moe is None:
            raise ValueError("Qwen3MoeForCausalLM: config.json names no experts (num_experts)")
        super().__init__(config)
        self.stacked_params_mapping = tuple(expert_params_mapping(config.moe.num_experts)) + (
            LlamaForCausalLM.stacked_params_mapping
        )

    def build_mlp(self, layer_id: int, mlp_group: GroupCoordinator) -> Optional[nn.Module]:
        """The sparse block on sparse layers, the dense gated MLP elsewhere."""
        if not self.config.moe.is_sparse_layer(layer_id):
            return None
        return Qwen3MoeSparseMoeBlock(self.config, mlp_group)
