"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2): multi-head latent attention (MLA) and routed experts.

MLA. Each token stores one latent per layer in the MLA pool: the normalised compressed KV
(``kv_lora_rank``) and the rotated rope key (``qk_rope_head_dim``), shared by every head. Attention runs
on the latent with the weights absorbed: the query's no-rope part is multiplied into latent space by
``W_UK`` (from ``kv_b_proj``), so every head attends over ``[compressed KV | rope key]`` as one
``kv_lora_rank + qk_rope_head_dim``-wide key of a single KV head (MQA), and the per-head output,
still in latent space, is lifted by ``W_UV``. K and V are never expanded, in prefill or decode.
Heads split over attention TP; the latent is replicated on every attention rank.

Rope acts on the ``qk_rope_head_dim`` part only. With ``rope_interleave`` (the default) the checkpoint
pairs dimensions ``(0, 1), (2, 3), ...``: they are de-interleaved before a rotate-half rotation, as the
reference does. YaRN scaling multiplies the softmax scale by ``mscale(factor, mscale_all_dim)**2``.

MoE (layers ``>= first_k_dense_replace``): sigmoid router scores plus ``e_score_correction_bias`` choose
the experts within the ``topk_group`` best of ``n_group`` groups; the chosen experts' plain scores,
renormalised and scaled by ``routed_scaling_factor``, weight them; shared experts are added. Routed and
shared partial sums share one all-reduce.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.attention.radix_attention import RadixAttention
from sglite.srt.layers.layernorm import RMSNorm
from sglite.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglite.srt.layers.moe.layer import FusedMoE, expert_params_mapping
from sglite.srt.layers.moe.topk import TopKConfig
from sglite.srt.layers.rotary_embedding import get_rope, yarn_get_mscale
from sglite.srt.model_executor.forward_batch_info import ForwardBatch
from sglite.srt.models.llama import LlamaForCausalLM, LlamaMLP
from sglite.srt.runtime_context import get_parallel

# The reference builds the latent norms with its RMSNorm's default epsilon, not the config's.
_LATENT_NORM_EPS = 1e-6


def _text_config(config: ModelConfig) -> dict:
    return config.hf_config.get("text_config") or config.hf_config


class DeepseekV2MLAAttention(nn.Module):
    """MLA with absorbed weights over the latent pool (see the module docstring)."""

    def __init__(self, config: ModelConfig, layer_id: int, tp_group: GroupCoordinator) -> None:
        super().__init__()
        hf = _text_config(config)
        self.layer_id = layer_id
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.qk_nope_head_dim = config.head_dim - self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_lora_rank = hf.get("q_lora_rank")
        qk_head_dim = config.head_dim
        total_heads = config.num_attention_heads
        bias = config.attention_bias
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, int(self.q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), eps=_LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                int(self.q_lora_rank), total_heads * qk_head_dim, bias=False, tp_group=tp_group
            )
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, total_heads * qk_head_dim, bias=False, tp_group=tp_group)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False, tp_group=tp_group
        )
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, config.hidden_size, bias=bias, tp_group=tp_group)
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.qk_nope_head_dim + self.v_head_dim)

        self.rotary_emb = get_rope(
            self.qk_rope_head_dim, self.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )
        # The checkpoint's (x0, x1), (x2, x3), ... rope pairs as rotate-half halves: evens then odds.
        rope = self.qk_rope_head_dim
        self.rope_perm: Optional[torch.Tensor] = None
        if hf.get("rope_interleave", True):
            self.rope_perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        scaling = qk_head_dim**-0.5
        rs = config.rope_scaling
        if rs and rs.get("mscale_all_dim"):
            m = yarn_get_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
            scaling *= m * m
        # One KV head whose key is the whole latent and whose value is its compressed part.
        self.attn = RadixAttention(
            self.num_heads, self.kv_lora_rank + rope, scaling, num_kv_heads=1, layer_id=layer_id,
            v_head_dim=self.kv_lora_rank, mla_rope_dim=rope,
        )
        self.w_kc: Optional[nn.Parameter] = None  # [heads, qk_nope, kv_lora]: set after loading
        self.w_vc: Optional[nn.Parameter] = None  # [heads, v, kv_lora]

    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into the absorbed ``W_UK`` and ``W_UV`` (per head, latent on the last axis), then drop it.

        Attention never expands K/V, so ``kv_b_proj`` has no other use: keeping it would hold its bytes twice
        (about 2 GB over DeepSeek-V3's layers in bf16). The two halves stay parameters, the weights a rank holds.
        """
        w = self.kv_b_proj.weight.detach().unflatten(0, (self.num_heads, self.qk_nope_head_dim + self.v_head_dim))
        self.w_kc = nn.Parameter(w[:, : self.qk_nope_head_dim].contiguous(), requires_grad=False)
        self.w_vc = nn.Parameter(w[:, self.qk_nope_head_dim :].contiguous(), requires_grad=False)
        del self.kv_b_proj

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.rope_perm is not None:
            x = x.index_select(-1, self.rope_perm.to(x.device))
        return self.rotary_emb.rotate_heads(positions, x)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Latent attention of the new tokens over their requests' cached latents."""
        if self.w_kc is None:
            raise RuntimeError("DeepseekV2MLAAttention used before process_weights_after_loading()")
        t, h = hidden_states.shape[0], self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(hidden_states)))
        else:
            q = self.q_proj.forward(hidden_states)
        # Explicit sizes: an IDLE forward (DP attention) has t = 0, where -1 is ambiguous.
        q_nope, q_pe = q.view(t, h, self.qk_nope_head_dim + self.qk_rope_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        kv_c, k_pe = self.kv_a_proj_with_mqa.forward(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_c = self.kv_a_layernorm.forward(kv_c.contiguous())
        q_pe = self._rope(positions, q_pe)
        k_pe = self._rope(positions, k_pe.reshape(t, 1, self.qk_rope_head_dim))
        # Absorb W_UK: [h, t, nope] @ [h, nope, kv_lora] -> the query in latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_kc.to(q_nope.dtype)).transpose(0, 1)
        query = torch.cat([q_latent, q_pe], dim=-1)  # [t, h, kv_lora + rope]
        latent = torch.cat([kv_c.unsqueeze(1), k_pe], dim=-1)  # [t, 1, kv_lora + rope]
        o = self.attn.forward(query, latent, kv_c.unsqueeze(1), forward_batch)  # [t, h * kv_lora]
        # Lift with W_UV: [h, t, kv_lora] @ [h, kv_lora, v] -> [t, h, v].
        o = torch.bmm(o.view(t, h, self.kv_lora_rank).transpose(0, 1), self.w_vc.to(o.dtype).transpose(1, 2))
        return self.o_proj.forward(o.transpose(0, 1).reshape(t, h * self.v_head_dim))


class DeepseekV2MoE(nn.Module):
    """Grouped sigmoid router with a score-correction bias, routed experts, and shared experts."""

    def __init__(self, config: ModelConfig, mlp_group: GroupCoordinator) -> None:
        super().__init__()
        hf, moe = _text_config(config), config.moe
        self.mlp_group = mlp_group
        router_dtype = torch.float32 if moe.router_fp32 else None  # the reference keeps the router in fp32
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts, bias=False, params_dtype=router_dtype)
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False
        )
        n_group = hf.get("n_group")
        self.experts = FusedMoE(
            num_experts=moe.num_experts,
            hidden_size=config.hidden_size,
            intermediate_size=moe.moe_intermediate_size,
            topk=TopKConfig(
                top_k=moe.top_k,
                scoring_func=str(hf.get("scoring_func", "sigmoid")),
                renormalize=bool(hf.get("norm_topk_prob", True)),
                num_expert_group=int(n_group) if n_group else None,
                topk_group=int(hf["topk_group"]) if n_group else None,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            ),
            tp_group=mlp_group,
            ep_size=get_parallel().ep_size,
            reduce_results=False,
        )
        self.shared_experts: Optional[LlamaMLP] = None
        if moe.num_shared_experts:
            self.shared_experts = LlamaMLP(
                config.hidden_size, moe.moe_intermediate_size * moe.num_shared_experts, config.hidden_act, False,
                mlp_group,
            )
            self.shared_experts.down_proj.reduce_results = False  # summed with the routed partials below

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed experts plus shared experts, one all-reduce for both."""
        logits = self.gate.forward(hidden_states.to(self.gate.weight.dtype))
        out = self.experts.forward(hidden_states, logits, self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward(hidden_states)
        if self.mlp_group.world_size > 1:
            out = self.mlp_group.all_reduce(out)
        return out


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The Llama-family skeleton (embedding, residual stream, head, DP attention, aux capture) with MLA and MoE."""

    def __init__(self, config: ModelConfig) -> None:
        if config.kv_lora_rank is None or config.qk_rope_head_dim is None:
            raise ValueError("DeepseekV3ForCausalLM: config.json needs kv_lora_rank and qk_rope_head_dim (MLA)")
        if config.moe is None:
            raise ValueError("DeepseekV3ForCausalLM: config.json names no routed experts (n_routed_experts)")
        super().__init__(config)
        # Experts before gate/up: a shared expert's ``.gate_proj`` fuses into its own gate_up_proj.
        self.stacked_params_mapping = tuple(expert_params_mapping(config.moe.num_experts)) + (
            (".gate_proj", ".gate_up_proj", 0),
            (".up_proj", ".gate_up_proj", 1),
        )

    def build_attention(self, layer_id: int, attn_tp_group: GroupCoordinator) -> Optional[nn.Module]:
        """MLA on every layer."""
        return DeepseekV2MLAAttention(self.config, layer_id, attn_tp_group)

    def build_mlp(self, layer_id: int, mlp_group: GroupCoordinator) -> Optional[nn.Module]:
        """MoE past ``first_k_dense_replace``, the dense gated MLP before."""
        if not self.config.moe.is_sparse_layer(layer_id):
            return None
        return DeepseekV2MoE(self.config, mlp_group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors, less the multi-token-prediction layers stored past the last layer."""
        return super().load_weights(self._without_mtp_layers(weights))

    def _without_mtp_layers(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        n = self.config.num_hidden_layers
        for name, tensor in weights:
            m = _LAYER_INDEX.match(name)
            if m is None or int(m.group(1)) < n:
                yield name, tensor
