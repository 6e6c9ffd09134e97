"""A CPU fp32 kernel for linear layers at 2-16 rows: one pass over the weight for all rows (csrc/small_m_linear.cpp).

A decode step at batch 2-16, and a DFLASH verify block at batch 1-3 (5 rows a request), is a stream of the
weights from memory. Over SmolLM2's layers and head, one thread, the best BLAS pack (layers/cpu_gemm.py) costs
1.41x the one-row gemv at 5 rows, 1.58x at 8 and 1.93x at 16; this kernel 1.12x, 1.25x and 1.75x
(docs/benchmarks.md, "A small-M CPU kernel"). Past ~24 rows the packs' compute kernels win.

It is C++ built on first use with torch's extension builder (ninja and the host's C++ compiler, ``-march=native``)
into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); later processes
load the cached build. Without a compiler it is not built, a warning says why, and the packs serve those rows.
``SGLITE_CPU_SMALL_M_KERNEL=0`` turns it off (for A/Bs).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

SMALL_M_MIN_ROWS = 2  # one row is a gemv, already bandwidth-bound through F.linear
SMALL_M_MAX_ROWS = 16  # at 16 rows 0.91x the best pack's time, at 24 about level
SOURCE = Path(__file__).with_name("csrc") / "small_m_linear.cpp"
ENV_SWITCH = "SGLITE_CPU_SMALL_M_KERNEL"


@functools.cache
def small_m_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The built ``small_m_linear(x [M, K], w [N, K]) -> [M, N]``, or None (switched off, not x86, or no compiler)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU small-M kernel: off (%s=0)", ENV_SWITCH)
        return None
    if not torch.backends.mkldnn.is_available():  # x86 builds have it; the kernel's flags assume a GCC-like x86 host
        return None
    try:
        module = _build()
    except Exception as e:  # a missing compiler or ninja, a failed build: the packs serve these rows instead
        logger.warning("CPU small-M kernel not built (%s: %s); 2-16 row GEMMs use the BLAS pack", type(e).__name__, e)
        return None
    return module.small_m_linear


def _build():
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    path = os.environ.get("PATH", "")
    try:
        import ninja  # a dependency; its binary is not on PATH when the venv is not activated

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{path}"
    except ImportError:
        pass
    try:
        module = cpp_extension.load(
            name="sglite_small_m_linear",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native"],
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path
    logger.info("CPU small-M kernel: ready in %.1f s (%d-%d rows)", time.perf_counter() - t0, SMALL_M_MIN_ROWS, SMALL_M_MAX_ROWS)
    return module


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x W^T + b`` through the kernel when it applies (2-16 rows, fp32 CPU, no autograd), else None."""
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
