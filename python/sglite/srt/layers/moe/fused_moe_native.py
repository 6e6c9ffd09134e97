"""The expert computation in plain torch: for each local expert, its tokens through the gated MLP.

It is the reference the Triton path is checked against, and the CPU path. Experts are visited in
order and only where a token was routed to them, so the work is proportional to ``T * top_k``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused ``[gate | up]`` row block."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"MoE activation {activation!r} is not supported (silu, gelu)")


def fused_moe_native(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    first_local_expert: int = 0,
    activation: str = "silu",
) -> torch.Tensor:
    """Sum over each token's routed experts of ``weight * down(act(gate(x)) * up(x))``.

    ``w13`` ``[E_local, 2*I, H]`` (gate rows then up rows), ``w2`` ``[E_local, H, I]``; experts outside
    ``[first_local_expert, first_local_expert + E_local)`` live on other ranks and contribute nothing
    here (their partial sums arrive through the layer's all-reduce).
    """
    out = torch.zeros_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return out
    num_local = w13.shape[0]
    k = topk_ids.shape[1]
    flat_ids = (topk_ids - first_local_expert).reshape(-1)
    # One sort groups the (token, slot) pairs by expert: each local expert's pairs are one contiguous run,
    # bounded where the sorted ids first reach e and e + 1 (other ranks' experts fall outside [0, E_local)).
    order = torch.argsort(flat_ids, stable=True)
    bounds = torch.searchsorted(flat_ids[order], torch.arange(num_local + 1, device=flat_ids.device)).tolist()
    flat_weights = topk_weights.reshape(-1)
    for expert in range(num_local):
        begin, end = bounds[expert], bounds[expert + 1]
        if begin == end:
            continue
        pairs = order[begin:end]
        tokens = pairs // k
        h = act_and_mul(F.linear(hidden_states.index_select(0, tokens), w13[expert]), activation)
        y = F.linear(h, w2[expert]) * flat_weights[pairs, None].to(h.dtype)
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
