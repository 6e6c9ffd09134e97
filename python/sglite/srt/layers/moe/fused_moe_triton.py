"""The expert computation as two Triton grouped GEMMs over expert-sorted (token, slot) pairs.

1. ``align_pairs`` (torch): the pairs routed to this rank's experts, sorted by expert, each expert's run
   padded to a multiple of ``BLOCK_M`` with a sentinel; one expert id per block of ``BLOCK_M`` rows.
2. ``gate_up``: for each block, rows ``x[token(pair)] @ w13[expert].T`` → ``[pairs, 2I]``.
3. ``act(gate) * up`` (torch), then ``down``: rows ``h[pair] @ w2[expert].T * weight[pair]`` → ``[pairs, H]``.
4. The top-k slots of each token are summed.

Pairs routed to other ranks' experts are never written, so they contribute zero. Results equal
``fused_moe_native`` up to summation order (checked under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglite.srt.layers.attention.triton_ops.common import dot_in_fp32
from sglite.srt.layers.moe.fused_moe_native import act_and_mul, sort_pairs_by_expert

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr,
    n_cols, k_dim, num_pairs, top_k,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    ROWS_ARE_PAIRS: tl.constexpr,  # A is indexed by pair (the down GEMM), else by token = pair // top_k
    MUL_ROUTING_WEIGHT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < num_pairs  # the padding sentinel is num_pairs
    if ROWS_ARE_PAIRS:
        rows = pairs
    else:
        rows = pairs // top_k
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_dim, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=valid[:, None] & (ks[None, :] < k_dim), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < n_cols) & (ks[:, None] < k_dim), other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_ROUTING_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n_cols))


def align_pairs(
    topk_ids: torch.Tensor, num_local_experts: int, first_local_expert: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert, each expert padded to ``block_m`` with the sentinel ``T*k``; expert per block)."""
    num_pairs = topk_ids.numel()
    pairs, bounds = sort_pairs_by_expert(topk_ids, num_local_experts, first_local_expert)
    counts = bounds[1:] - bounds[:-1]
    experts = torch.repeat_interleave(torch.arange(num_local_experts, device=topk_ids.device), counts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    dest = padded_start[experts] + torch.arange(pairs.numel(), device=pairs.device) - bounds[:-1][experts]
    sorted_pairs = torch.full((int(padded.sum()),), num_pairs, dtype=torch.int64, device=topk_ids.device)
    sorted_pairs[dest] = pairs
    block_experts = torch.repeat_interleave(torch.arange(num_local_experts, device=topk_ids.device), padded // block_m)
    return sorted_pairs, block_experts


def _expert_gemm(a, w, out, weights, sorted_pairs, block_experts, top_k, rows_are_pairs, mul_weight) -> None:
    n_cols, k_dim = w.shape[1], w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n_cols, BLOCK_N))
    _expert_gemm_kernel[grid](
        a, w, out, weights, sorted_pairs, block_experts,
        n_cols, k_dim, weights.numel(), top_k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        ROWS_ARE_PAIRS=rows_are_pairs, MUL_ROUTING_WEIGHT=mul_weight, DOT_FP32=dot_in_fp32(a.dtype),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )


def fused_moe_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    first_local_expert: int = 0,
    activation: str = "silu",
) -> torch.Tensor:
    """Same contract as ``fused_moe_native``."""
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(hidden_states)
    sorted_pairs, block_experts = align_pairs(topk_ids, w13.shape[0], first_local_expert)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    gate_up = hidden_states.new_zeros((t * k, w13.shape[1]))
    if block_experts.numel():
        _expert_gemm(hidden_states, w13, gate_up, weights, sorted_pairs, block_experts, k, False, False)
    h = act_and_mul(gate_up, activation)
    down = hidden_states.new_zeros((t * k, w2.shape[1]))
    if block_experts.numel():
        _expert_gemm(h, w2, down, weights, sorted_pairs, block_experts, k, True, True)
    return down.view(t, k, -1).sum(dim=1)
