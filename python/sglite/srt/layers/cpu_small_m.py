"""A CPU fp32 kernel for linear layers at 2-16 rows: one pass over the weight for all rows (csrc/small_m_linear.cpp).

A decode step at batch 2-16, and a DFLASH verify block at batch 1-3 (5 rows a request), is a stream of the
weights from memory. Over SmolLM2's layers and head, one thread, the best BLAS pack (layers/cpu_gemm.py) costs
1.42x the one-row gemv at 5 rows, 1.56x at 8 and 1.91x at 16; this kernel 1.20x, 1.34x and 1.73x
(docs/benchmarks.md, "A small-M CPU kernel").

It is plain C++ built on first use (~3 s, while a first start loads the weights) into sglite's kernel cache and
called through ctypes (layers/cpu_kernel_build.py). Without a compiler it is not built, a warning says why, and the
packs serve those rows. ``SGLITE_CPU_SMALL_M_KERNEL=0`` turns it off (A/Bs).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from sglite.srt.layers.cpu_kernel_build import (  # noqa: F401 - cxx_compiler, KEPT_LIBRARIES: this kernel's too
    BASE_FLAGS,
    CSRC,
    KEPT_LIBRARIES,
    build_cpu_library,
    cxx_compiler,
    open_cpu_library,
)

logger = logging.getLogger(__name__)

SMALL_M_MIN_ROWS = 1  # a gemv too: on column-major weights it streams faster than F.linear's on some hosts
SMALL_M_MAX_ROWS = 16  # the most rows the kernel offers; at 40-64 the packs always won. Which rows of 1-16 it
# serves on a host is timed at start-up (cpu_gemm.choose_small_m_rows), not assumed here
SOURCE = CSRC / "small_m_linear.cpp"
ENV_SWITCH = "SGLITE_CPU_SMALL_M_KERNEL"
BUILD_FLAGS = BASE_FLAGS
_BUILD_LOCK = threading.Lock()  # one build per process; a second caller waits for it


def start_building_small_m_kernel() -> None:
    """Build (or load) the kernel in a background thread, so a first start compiles it while the weights load."""
    threading.Thread(target=small_m_kernel, name="sglite-small-m-build", daemon=True).start()


def small_m_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The built ``small_m_linear(x [M, K], w [N, K]) -> [M, N]``, or None (switched off, not x86, or no compiler)."""
    with _BUILD_LOCK:
        return _load_kernel()


@functools.cache
def _load_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    lib = open_cpu_library(SOURCE, BUILD_FLAGS, ENV_SWITCH, "CPU small-M kernel", "2-16 row GEMMs use the BLAS pack")
    if lib is None:
        return None
    fn = lib.sglite_small_m_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int]

    def small_m(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (m, k), n = x.shape, w.shape[0]
        if not (1 <= m <= SMALL_M_MAX_ROWS and w.shape[1] == k and x.stride(1) == 1):
            raise ValueError(f"small_m_linear: x {tuple(x.shape)} (rows contiguous, 1-{SMALL_M_MAX_ROWS}) and w {tuple(w.shape)}")
        if x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu" or w.device.type != "cpu":
            raise ValueError("small_m_linear: fp32 CPU tensors only")
        row_major = w.is_contiguous()
        if not (row_major or w.t().is_contiguous()):
            raise ValueError("small_m_linear: w must be row- or column-major")
        y = torch.empty(m, n, dtype=torch.float32)
        fn(x.data_ptr(), x.stride(0), w.data_ptr(), n, k, y.data_ptr(), m, int(row_major))
        return y

    return small_m


def _build() -> Path:
    """The compiled library's path (layers/cpu_kernel_build.py)."""
    return build_cpu_library(SOURCE, BUILD_FLAGS)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x W^T + b`` through the kernel when it applies (1-16 rows, fp32 CPU, no autograd), else None."""
    rows = x.numel() // x.shape[-1]
    if not SMALL_M_MIN_ROWS <= rows <= SMALL_M_MAX_ROWS or x.dtype != torch.float32:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    if not (weight.is_contiguous() or weight.t().is_contiguous()):  # row- or column-major only
        return None
    kernel = small_m_kernel()
    if kernel is None:
        return None
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = kernel(x2, weight)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
