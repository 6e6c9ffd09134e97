"""Paged extend attention: n new queries per request over ``req_to_token[row, :prefix + n]``.

One kernel serves EXTEND and TARGET_VERIFY (``causal=True``: query i at position P+i sees keys
``[0, P+i]``) and DRAFT_BLOCK (``causal=False``: every query sees ``[0, P+n)``). Keys are read from the
paged pool through req_to_token, so any page size and slot layout works; the caller has written the
new tokens' K/V into the pool first. Flash-attention style online softmax in the log2 domain.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglite.srt.layers.attention.triton_ops.common import INTERPRET, attend_kv_tile, prepare_launch, select_kernel


@triton.jit
def _extend_attn_kernel(
    Q,
    O,
    K_Buf,
    V_Buf,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Q_start,
    sm_scale_log2,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    group,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    n_new = tl.load(Extend_lens + b)
    if mb * BLOCK_M >= n_new:
        return
    prefix = tl.load(Prefix_lens + b)
    q_start = tl.load(Q_start + b)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    seq_len = prefix + n_new
    kvh = h // group

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < n_new
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < V_HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        # The block's first query sees nothing before position q_pos - window + 1.
        lo = tl.maximum(0, prefix + mb * BLOCK_M - sliding_window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N

    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            q, acc, m_i, l_i, start, hi, K_Buf, V_Buf, Req_to_token, row, stride_r2t,
            kvh, stride_ks, stride_kh, stride_vs, stride_vh, offs_d, mask_d, offs_dv, mask_dv,
            mask_m, q_pos, sm_scale_log2, sliding_window, CAUSAL, USE_WINDOW, DOT_FP32, BLOCK_N,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :], out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


# Large blocks in the interpreter (its cost is per program); a safe middle config when not autotuning.
_FIXED_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64} if INTERPRET else {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

# triton.autotune needs a live driver, so the interpreter only ever calls the plain kernel.
_extend_kernel_tuned = None
if not INTERPRET:
    _extend_kernel_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2)]
        ],
        key=["HEAD_DIM", "V_HEAD_DIM", "CAUSAL", "USE_WINDOW", "DOT_FP32"],
    )(_extend_attn_kernel)
# The kernel object aot_check compiles (the autotuned wrapper where there is one).
_extend_kernel = _extend_kernel_tuned if _extend_kernel_tuned is not None else _extend_attn_kernel


def extend_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    causal: bool,
    sliding_window: Optional[int] = None,
) -> None:
    """Write attention of q ``[T, H, D]`` into o ``[T, H, Dv]`` over the paged K/V ``[S, Hkv, D|Dv]``."""
    launch = prepare_launch(q, o, k_buf, v_buf, sm_scale, causal, sliding_window)
    bs = req_pool_indices.shape[0]
    if bs == 0 or max_extend_len == 0:
        return
    kernel, blocks = select_kernel(_extend_kernel_tuned, _extend_attn_kernel, _FIXED_BLOCKS)

    def grid(m: dict) -> tuple[int, int, int]:
        return (bs, launch.num_heads, triton.cdiv(max_extend_len, m["BLOCK_M"]))

    kernel[grid](
        q, o, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_start,
        launch.sm_scale_log2, launch.sliding_window,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        launch.num_heads // launch.num_kv_heads,
        **launch.meta,
        **blocks,
    )
