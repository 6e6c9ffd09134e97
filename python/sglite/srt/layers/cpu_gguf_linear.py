"""Linear layers on a GGUF file's quantized blocks (Q4_0, Q4_1, Q8_0) at 1-16 rows, on CPU (csrc/gguf_linear.cpp).

A GGUF checkpoint is dequantized to fp32 at load, and every kernel can read that copy. At decode batch sizes a
linear is a stream of its weight, and the fp32 copy of a 4-bit model is 6.4x the bytes of its blocks; this kernel
reads the blocks instead and dequantizes them in registers, bit for bit as the loader did (so the product is the
product with the same fp32 weights, up to summation order). On SmolLM2's Q4_1 layers and Q8_0 head, one thread, it
takes 16.4 ms at one row where the fp32 gemv takes 32.8 (docs/benchmarks.md, "GGUF blocks read as they are stored").
Which row counts it serves on a host is timed at start-up (cpu_gemm.choose_gguf_rows).

Each output element is summed in one fixed order whatever the row count, so row m of a 5-row product (a DFLASH
verify) equals the 1-row product (a decode step) bit for bit. ``SGLITE_CPU_GGUF_KERNEL=0`` turns it off (A/Bs).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from sglite.srt.layers.cpu_kernel_build import BASE_FLAGS, CSRC, open_cpu_library

SOURCE = CSRC / "gguf_linear.cpp"
ENV_SWITCH = "SGLITE_CPU_GGUF_KERNEL"
# No contraction: the dequantization's `d * q + m` must round twice, as numpy does in the gguf package.
BUILD_FLAGS = (*BASE_FLAGS, "-ffp-contract=off")
GGUF_MAX_ROWS = 16  # the most rows the kernel offers (past that the fp32 packs' compute wins)
GGUF_BLOCK = 32  # weights per block, every type below
# GGML type id -> (name, bytes per block of 32 weights): the types the kernel reads.
GGUF_LINEAR_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class GGUFWeight:
    """A linear weight [out, in] as its GGUF blocks: ``blocks`` uint8 [out, in / 32 * bytes per block]."""

    blocks: torch.Tensor
    ggml_type: int
    in_features: int

    @property
    def out_features(self) -> int:
        """Rows of the weight (output features)."""
        return self.blocks.shape[0]

    @property
    def type_name(self) -> str:
        """The GGML type's name, e.g. ``Q4_1``."""
        return GGUF_LINEAR_TYPES[self.ggml_type][0]


def gguf_weight_from_rows(blocks: torch.Tensor, ggml_type: int, in_features: int) -> GGUFWeight:
    """A GGUFWeight after checking the type is one the kernel reads and the row size matches ``in_features``."""
    if ggml_type not in GGUF_LINEAR_TYPES:
        raise ValueError(f"GGML type {ggml_type} is not one the GGUF linear kernel reads ({sorted(GGUF_LINEAR_TYPES)})")
    name, block_bytes = GGUF_LINEAR_TYPES[ggml_type]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % GGUF_BLOCK or not blocks.is_contiguous():
        raise ValueError(f"{name} blocks must be a contiguous uint8 [rows, bytes] tensor over whole blocks of {GGUF_BLOCK}")
    if blocks.shape[1] != in_features // GGUF_BLOCK * block_bytes:
        raise ValueError(f"{name} rows of {blocks.shape[1]} bytes do not hold {in_features} weights")
    return GGUFWeight(blocks, ggml_type, in_features)


def start_building_gguf_kernel() -> None:
    """Build (or load) the kernel in a background thread, so a first start compiles it while the weights load."""
    threading.Thread(target=_library, name="sglite-gguf-build", daemon=True).start()


def gguf_kernel_available() -> bool:
    """Whether the kernel is built here (not switched off, x86, a compiler)."""
    return _library() is not None


def _library() -> Optional[ctypes.CDLL]:
    with _BUILD_LOCK:
        return _open()


@functools.cache
def _open() -> Optional[ctypes.CDLL]:
    lib = open_cpu_library(SOURCE, BUILD_FLAGS, ENV_SWITCH, "CPU GGUF kernel", "GGUF linears read their fp32 copy")
    if lib is None:
        return None
    lib.sglite_gguf_linear.restype = ctypes.c_int
    lib.sglite_gguf_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.sglite_gguf_dequantize.restype = ctypes.c_int
    lib.sglite_gguf_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x W^T + b`` from W's blocks (a GGUFWeight's ``blocks``, 1-16 rows of fp32 ``x``, no autograd), else None
    (the caller's fp32 path)."""
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    if not 1 <= rows <= GGUF_MAX_ROWS or x.dtype != torch.float32:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    lib = _library()
    if lib is None:
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = blocks.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    if lib.sglite_gguf_linear(x2.data_ptr(), x2.stride(0), blocks.data_ptr(), n, k, y.data_ptr(), rows, ggml_type) != 0:
        raise RuntimeError(f"gguf_linear refused GGML type {ggml_type} [{n}, {k}] at {rows} rows")
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def gguf_dequantize(weight: GGUFWeight) -> torch.Tensor:
    """The weight as fp32 [out, in], bit-equal to ``gguf.quants.dequantize`` (the loader's fp32 copy)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU GGUF kernel is not built here")
    out = torch.empty(weight.out_features, weight.in_features, dtype=torch.float32)
    if lib.sglite_gguf_dequantize(weight.blocks.data_ptr(), weight.out_features, weight.in_features, out.data_ptr(),
                                  weight.ggml_type) != 0:
        raise RuntimeError(f"gguf_dequantize refused {weight.type_name}")
    return out
