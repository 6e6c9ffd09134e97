"""Shared helpers of the Triton attention kernels: interpreter detection, block sizes, launch arguments, the K/V tile step."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

# TRITON_INTERPRET is read when @triton.jit runs, so the kernels' mode is fixed at import time.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

LOG2E = 1.4426950408889634


def autotune_enabled() -> bool:
    """Whether compiled launches autotune (CUDA only; the interpreter never does).

    ``SGLITE_TRITON_AUTOTUNE=0`` uses one fixed config per kernel instead: one compile per variant,
    which keeps the GPU equality tests short. Read at launch time, so tests can switch it.
    """
    return not INTERPRET and os.environ.get("SGLITE_TRITON_AUTOTUNE", "1") != "0"


def head_block(dim: int) -> int:
    """Power-of-two block covering a head dim (at least 16, the smallest tl.dot operand)."""
    return max(16, triton.next_power_of_2(dim))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels cast operands to fp32 before tl.dot.

    The interpreter's bf16 tl.dot is broken (triton #11584), so it always computes in fp32; on GPU
    fp16/bf16 use native tensor-core dots and fp32 inputs use IEEE fp32 dots (not tf32).
    """
    return INTERPRET or dtype == torch.float32


def check_kv_dtype(q: torch.Tensor, k_buf: torch.Tensor) -> None:
    """The kernels read K/V in the query dtype or fp8 (cast on load); anything else is an error."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if k_buf.dtype != q.dtype and k_buf.dtype not in fp8:
        raise TypeError(f"KV pool dtype {k_buf.dtype} differs from query dtype {q.dtype}; set --kv-cache-dtype auto")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels address the head dim with unit stride; other strides are free (e.g. a slice of fused QKV)."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on its last dim (got strides {tuple(t.stride())})")


@dataclass(frozen=True)
class AttnLaunch:
    """What both launchers derive from q and the K/V pool: head geometry, scalar arguments, shared constexprs."""

    num_heads: int
    num_kv_heads: int
    v_head_dim: int
    sm_scale_log2: float
    sliding_window: int  # 0 when USE_WINDOW is off (never read then)
    meta: dict[str, Any]  # HEAD_DIM, V_HEAD_DIM, BLOCK_D, BLOCK_DV, CAUSAL, USE_WINDOW, DOT_FP32


def prepare_launch(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    sm_scale: float,
    causal: bool,
    sliding_window: Optional[int],
) -> AttnLaunch:
    """Check dtypes and strides, then build the launch arguments the extend and split-K kernels share."""
    check_kv_dtype(q, k_buf)
    check_last_dim_contiguous(q=q, o=o, k_buf=k_buf, v_buf=v_buf)
    head_dim, v_head_dim = q.shape[2], v_buf.shape[2]
    meta = dict(
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_DV=head_block(v_head_dim),
        CAUSAL=causal,
        USE_WINDOW=sliding_window is not None,
        DOT_FP32=dot_in_fp32(q.dtype),
    )
    return AttnLaunch(
        num_heads=q.shape[1],
        num_kv_heads=k_buf.shape[1],
        v_head_dim=v_head_dim,
        sm_scale_log2=sm_scale * LOG2E,
        sliding_window=0 if sliding_window is None else sliding_window,
        meta=meta,
    )


def select_kernel(tuned: Any, plain: Any, fixed_blocks: dict[str, int]) -> tuple[Any, dict[str, int]]:
    """The kernel to launch and the block meta it needs: the autotuned one and none, or the plain one and ``fixed_blocks``."""
    if autotune_enabled():
        return tuned, {}
    return plain, fixed_blocks


@triton.jit
def attend_kv_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    hi,
    K_Buf,
    V_Buf,
    Req_to_token,
    row,
    stride_r2t,
    kvh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    offs_d,
    mask_d,
    offs_dv,
    mask_dv,
    mask_q,
    q_pos,
    sm_scale_log2,
    sliding_window,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One online-softmax step over keys ``[start, start + BLOCK_N) ∩ [0, hi)`` read through req_to_token.

    q rows are masked by ``mask_q`` and sit at positions ``q_pos``; scores are in the log2 domain.
    Returns the updated ``(acc, m_i, l_i)``.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    slots = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
    k = tl.load(K_Buf + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
    if DOT_FP32:
        qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, k.to(q.dtype))
    qk = qk * sm_scale_log2
    valid = mask_q[:, None] & mask_n[None, :]
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        valid = valid & ((q_pos[:, None] - offs_n[None, :]) < sliding_window)
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rows with no visible key yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN.
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
    return acc, m_new, l_i
