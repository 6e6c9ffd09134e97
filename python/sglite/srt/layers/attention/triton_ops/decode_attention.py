"""Paged decode attention, split-K (flash-decoding): one query per request over ``req_to_token[row, :seq_len]``.

Stage 1 splits each request's keys into ``num_kv_splits`` chunks and computes, per chunk, the
partial output and its log-sum-exp for all query heads that share one KV head (so a K/V tile is read
once per GQA group). Stage 2 merges the chunks. The split count is fixed per call, independent of the
sequence lengths, so shapes stay static (CUDA-graph friendly); empty chunks contribute nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglite.srt.layers.attention.triton_ops.common import (
    INTERPRET,
    autotune_enabled,
    LOG2E,
    check_kv_dtype,
    check_last_dim_contiguous,
    dot_in_fp32,
    head_block,
)


@triton.jit
def _decode_split_kernel(
    Q,
    K_Buf,
    V_Buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_O,
    Mid_LSE,
    sm_scale_log2,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    group,
    blocks_per_group,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    kvh = hblk // blocks_per_group
    offs_g = (hblk % blocks_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < group
    heads = kvh * group + offs_g

    seq_len = tl.load(Seq_lens + b)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(seq_len, lo + chunk)
    if USE_WINDOW:
        # The query sits at seq_len - 1 and sees keys k with (seq_len - 1) - k < window.
        lo = tl.maximum(lo, seq_len - sliding_window)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < V_HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_Buf + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        if DOT_FP32:
            qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, k.to(q.dtype))
        qk = qk * sm_scale_log2
        qk = tl.where(mask_h[:, None] & mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_Buf + slots[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    base_o = Mid_O + b.to(tl.int64) * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_dv[None, :]
    tl.store(base_o, out, mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(Mid_LSE + b.to(tl.int64) * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Mid_O,
    Mid_LSE,
    O,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ot,
    stride_oh,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < NUM_SPLITS
    mask_dv = offs_dv < V_HEAD_DIM
    lse = tl.load(Mid_LSE + b * stride_ml_b + h * stride_ml_h + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    parts = tl.load(
        Mid_O + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_dv[None, :],
        mask=mask_s[:, None] & mask_dv[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + b * stride_ot + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=mask_dv)


_FIXED_BLOCKS = {"BLOCK_N": 128} if INTERPRET else {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

_decode_kernel_tuned = None
if not INTERPRET:
    _decode_kernel_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in [(32, 4, 2), (64, 4, 2), (128, 4, 2), (64, 8, 3)]
        ],
        key=["HEAD_DIM", "V_HEAD_DIM", "BLOCK_H", "NUM_SPLITS", "USE_WINDOW", "DOT_FP32"],
    )(_decode_split_kernel)
_decode_kernel = _decode_kernel_tuned if _decode_kernel_tuned is not None else _decode_split_kernel


def decode_block_h(group: int) -> int:
    """Query heads handled together per program: a whole GQA group when it fits (at least 16 for tl.dot)."""
    return max(16, min(64, triton.next_power_of_2(group)))


def alloc_decode_buffers(
    batch_size: int, num_heads: int, v_head_dim: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for stage 1: partial outputs ``[bs, H, splits, Dv]`` and their log2-sum-exp ``[bs, H, splits]``."""
    mid_o = torch.empty((batch_size, num_heads, num_kv_splits, v_head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((batch_size, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    sliding_window: Optional[int] = None,
    mid_o: Optional[torch.Tensor] = None,
    mid_lse: Optional[torch.Tensor] = None,
) -> None:
    """Write decode attention of q ``[bs, H, D]`` into o ``[bs, H, Dv]``; keys are ``req_to_token[row, :seq_len]``."""
    check_kv_dtype(q, k_buf)
    check_last_dim_contiguous(q=q, o=o, k_buf=k_buf, v_buf=v_buf)
    bs, num_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_buf.shape[1], v_buf.shape[2]
    if bs == 0:
        return
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 (got {num_kv_splits})")
    if mid_o is None or mid_lse is None:
        mid_o, mid_lse = alloc_decode_buffers(bs, num_heads, v_head_dim, num_kv_splits, q.device)
    group = num_heads // num_kv_heads
    block_h = decode_block_h(group)
    blocks_per_group = triton.cdiv(group, block_h)
    block_dv = head_block(v_head_dim)
    meta = dict(
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_DV=block_dv,
        BLOCK_H=block_h,
        NUM_SPLITS=num_kv_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_FP32=dot_in_fp32(q.dtype),
    )
    kernel = _decode_kernel_tuned if autotune_enabled() else _decode_split_kernel
    if kernel is _decode_split_kernel:
        meta.update(_FIXED_BLOCKS)
    kernel[(bs, num_kv_heads * blocks_per_group, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale * LOG2E, 0 if sliding_window is None else sliding_window,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        group, blocks_per_group,
        **meta,
    )
    _decode_merge_kernel[(bs, num_heads)](
        mid_o, mid_lse, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), o.stride(0), o.stride(1),
        V_HEAD_DIM=v_head_dim, BLOCK_DV=block_dv, NUM_SPLITS=num_kv_splits, BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
    )
