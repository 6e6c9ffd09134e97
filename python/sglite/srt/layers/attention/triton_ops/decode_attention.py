"""Paged split-K (flash-decoding) attention for few queries per request: DECODE and small blocks.

Stage 1 splits each request's keys ``req_to_token[row, :seq_len]`` into ``num_kv_splits`` chunks.
One program takes one chunk for one KV head and a tile of rows, each row a (query token, query
head) pair of that KV head's GQA group, so a K/V tile is read once for all of them. It writes each
row's partial output and log2-sum-exp. Stage 2 merges the chunks per (token, head).

DECODE is the case of one query per request (position seq_len - 1). Blocks of n ≤ 32 queries per
request (TARGET_VERIFY causal, DRAFT_BLOCK non-causal, short EXTENDs) use the same kernel with
query i at position P+i: at small batch this spreads a long context over many programs, which
the one-program-per-query-tile extend kernel cannot. The split count is fixed per call and never
depends on sequence lengths, so shapes stay static (CUDA-graph friendly); empty chunks add nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglite.srt.layers.attention.triton_ops.common import INTERPRET, attend_kv_tile, prepare_launch, select_kernel

# Longest per-request block the split-K kernel takes (rows per tile = block x heads per tile).
MAX_SPLIT_BLOCK = 32


@triton.jit
def _split_kv_kernel(
    Q,
    K_Buf,
    V_Buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Extend_lens,
    Q_start,
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
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    group,
    blocks_per_group,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_DECODE: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    kvh = hblk // blocks_per_group

    seq_len = tl.load(Seq_lens + b)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    if IS_DECODE:
        n_new = 1
        q_start = b
    else:
        n_new = tl.load(Extend_lens + b)
        q_start = tl.load(Q_start + b)
    prefix = seq_len - n_new

    # Row r of the tile is query token r // BLOCK_G and query head kvh*group + (r % BLOCK_G) (+ block offset).
    offs_r = tl.arange(0, BLOCK_Q * BLOCK_G)
    qi = offs_r // BLOCK_G
    gi = (hblk % blocks_per_group) * BLOCK_G + offs_r % BLOCK_G
    mask_r = (qi < n_new) & (gi < group)
    heads = kvh * group + gi
    tokens = (q_start + qi).to(tl.int64)
    q_pos = prefix + qi

    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(seq_len, lo + chunk)
    if USE_WINDOW:
        # The earliest query sits at `prefix` and sees keys k with prefix - k < window.
        lo = tl.maximum(lo, prefix - sliding_window + 1)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < V_HEAD_DIM
    q = tl.load(Q + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            q, acc, m_i, l_i, start, hi, K_Buf, V_Buf, Req_to_token, row, stride_r2t,
            kvh, stride_ks, stride_kh, stride_vs, stride_vh, offs_d, mask_d, offs_dv, mask_dv,
            mask_r, q_pos, sm_scale_log2, sliding_window, CAUSAL, USE_WINDOW, DOT_FP32, BLOCK_N,
        )

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    base_o = Mid_O + tokens[:, None] * stride_mo_t + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_dv[None, :]
    tl.store(base_o, out, mask=mask_r[:, None] & mask_dv[None, :])
    tl.store(Mid_LSE + tokens * stride_ml_t + heads * stride_ml_h + split, lse, mask=mask_r)


@triton.jit
def _decode_merge_kernel(
    Mid_O,
    Mid_LSE,
    O,
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    stride_ot,
    stride_oh,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < NUM_SPLITS
    mask_dv = offs_dv < V_HEAD_DIM
    lse = tl.load(Mid_LSE + t * stride_ml_t + h * stride_ml_h + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    parts = tl.load(
        Mid_O + t * stride_mo_t + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_dv[None, :],
        mask=mask_s[:, None] & mask_dv[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=mask_dv)


_FIXED_BLOCKS = {"BLOCK_N": 128} if INTERPRET else {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

_split_kernel_tuned = None
if not INTERPRET:
    _split_kernel_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in [(32, 4, 2), (64, 4, 2), (128, 4, 2), (64, 8, 3)]
        ],
        key=["HEAD_DIM", "V_HEAD_DIM", "BLOCK_Q", "BLOCK_G", "NUM_SPLITS", "CAUSAL", "USE_WINDOW", "DOT_FP32"],
    )(_split_kv_kernel)
# The kernel object aot_check compiles (the autotuned wrapper where there is one).
_decode_kernel = _split_kernel_tuned if _split_kernel_tuned is not None else _split_kv_kernel


def split_tile(group: int, block_q: int) -> tuple[int, int]:
    """(BLOCK_G heads per tile, blocks per GQA group) for ``block_q`` queries per request.

    Rows = block_q x BLOCK_G: a whole GQA group when it fits in 128 rows, and at least 16 rows (tl.dot).
    """
    block_g = min(triton.next_power_of_2(group), max(1, 128 // block_q))
    block_g = max(block_g, triton.cdiv(16, block_q))
    return block_g, triton.cdiv(group, block_g)


def alloc_decode_buffers(
    num_tokens: int, num_heads: int, v_head_dim: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for stage 1: partial outputs ``[T, H, splits, Dv]`` and their log2-sum-exp ``[T, H, splits]``."""
    mid_o = torch.empty((num_tokens, num_heads, num_kv_splits, v_head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def _split_kv_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: Optional[torch.Tensor],
    q_start: Optional[torch.Tensor],
    block_q: int,
    sm_scale: float,
    causal: bool,
    num_kv_splits: int,
    sliding_window: Optional[int],
    mid_o: Optional[torch.Tensor],
    mid_lse: Optional[torch.Tensor],
) -> None:
    launch = prepare_launch(q, o, k_buf, v_buf, sm_scale, causal, sliding_window)
    num_tokens, num_heads = q.shape[0], launch.num_heads
    bs = req_pool_indices.shape[0]
    if bs == 0 or num_tokens == 0:
        return
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 (got {num_kv_splits})")
    if mid_o is None or mid_lse is None:
        mid_o, mid_lse = alloc_decode_buffers(num_tokens, num_heads, launch.v_head_dim, num_kv_splits, q.device)
    group = num_heads // launch.num_kv_heads
    block_g, blocks_per_group = split_tile(group, block_q)
    is_decode = extend_lens is None
    kernel, blocks = select_kernel(_split_kernel_tuned, _split_kv_kernel, _FIXED_BLOCKS)
    # Decode passes seq_lens for the unused extend pointers (never read when IS_DECODE).
    kernel[(bs, launch.num_kv_heads * blocks_per_group, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
        seq_lens if is_decode else extend_lens, seq_lens if is_decode else q_start,
        mid_o, mid_lse,
        launch.sm_scale_log2, launch.sliding_window,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        group, blocks_per_group,
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        NUM_SPLITS=num_kv_splits,
        IS_DECODE=is_decode,
        **launch.meta,
        **blocks,
    )
    _decode_merge_kernel[(num_tokens, num_heads)](
        mid_o, mid_lse, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), o.stride(0), o.stride(1),
        V_HEAD_DIM=launch.v_head_dim, BLOCK_DV=launch.meta["BLOCK_DV"], NUM_SPLITS=num_kv_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
    )


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
    _split_kv_attention(
        q, o, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, None, None, 1,
        sm_scale, True, num_kv_splits, sliding_window, mid_o, mid_lse,
    )


def block_split_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    causal: bool,
    num_kv_splits: int,
    sliding_window: Optional[int] = None,
    mid_o: Optional[torch.Tensor] = None,
    mid_lse: Optional[torch.Tensor] = None,
) -> None:
    """Split-K attention of ≤ ``MAX_SPLIT_BLOCK`` new queries per request (q ``[T, H, D]`` → o ``[T, H, Dv]``)."""
    if not 1 <= max_extend_len <= MAX_SPLIT_BLOCK:
        raise ValueError(f"block_split_attention_fwd takes 1..{MAX_SPLIT_BLOCK} new tokens per request, got {max_extend_len}")
    _split_kv_attention(
        q, o, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, extend_lens, q_start,
        triton.next_power_of_2(max_extend_len), sm_scale, causal, num_kv_splits, sliding_window, mid_o, mid_lse,
    )
