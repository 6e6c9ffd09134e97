"""Shared helpers of the Triton attention kernels: interpreter detection and block sizes."""

from __future__ import annotations

import os

import torch
import triton

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
