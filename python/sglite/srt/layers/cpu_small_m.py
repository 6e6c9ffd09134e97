"""A CPU fp32 kernel for linear layers at 2-16 rows: one pass over the weight for all rows (csrc/small_m_linear.cpp).

A decode step at batch 2-16, and a DFLASH verify block at batch 1-3 (5 rows a request), is a stream of the
weights from memory. Over SmolLM2's layers and head, one thread, the best BLAS pack (layers/cpu_gemm.py) costs
1.42x the one-row gemv at 5 rows, 1.56x at 8 and 1.91x at 16; this kernel 1.20x, 1.34x and 1.73x
(docs/benchmarks.md, "A small-M CPU kernel").

It is plain C++ (no torch headers), compiled on first use with the host's C++ compiler (``$CXX``, else ``c++`` or
``g++``; ``-O3 -march=native -fopenmp``, ~3 s, while a first start loads the weights) into sglite's cache
(``$SGLITE_CACHE_DIR``, else ``~/.cache/sglite``, under ``kernels/``, keyed by source, flags, compiler and CPU),
and called through ctypes; later processes load the cached library. Without a compiler it is not built, a warning
says why, and the packs serve those rows. ``SGLITE_CPU_SMALL_M_KERNEL=0`` turns it off (A/Bs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from sglite.srt.configs.cache_dir import sglite_cache_dir

logger = logging.getLogger(__name__)

SMALL_M_MIN_ROWS = 2  # one row is a gemv, already bandwidth-bound through F.linear
SMALL_M_MAX_ROWS = 16  # the most rows the kernel offers; at 40-64 the packs always won. Which rows of 2-16 it
# serves on a host is timed at start-up (cpu_gemm.choose_small_m_rows), not assumed here
SOURCE = Path(__file__).with_name("csrc") / "small_m_linear.cpp"
ENV_SWITCH = "SGLITE_CPU_SMALL_M_KERNEL"
BUILD_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_BUILD_LOCK = threading.Lock()  # one build per process; a second caller waits for it
# Libraries kept in the cache: the newest built ones, by mtime (one per source version, compiler and CPU that shares
# the cache dir); older ones are deleted after a build, so upgrades do not pile up ~130 KB files forever.
KEPT_LIBRARIES = 4


def start_building_small_m_kernel() -> None:
    """Build (or load) the kernel in a background thread, so a first start compiles it while the weights load."""
    threading.Thread(target=small_m_kernel, name="sglite-small-m-build", daemon=True).start()


def small_m_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The built ``small_m_linear(x [M, K], w [N, K]) -> [M, N]``, or None (switched off, not x86, or no compiler)."""
    with _BUILD_LOCK:
        return _load_kernel()


@functools.cache
def _load_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU small-M kernel: off (%s=0)", ENV_SWITCH)
        return None
    if platform.machine() not in ("x86_64", "AMD64"):  # the vector code and -march=native assume x86
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no compiler, a failed build: the packs serve these rows instead
        logger.warning("CPU small-M kernel not built (%s); 2-16 row GEMMs use the BLAS pack", e)
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


def cxx_compiler() -> Optional[str]:
    """The compiler the kernel is built with: ``$CXX``, else ``c++`` or ``g++`` on PATH (None when there is none)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_identity() -> bytes:
    """The host CPU's model and feature flags (-march=native builds for them), where /proc/cpuinfo says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def _build() -> Path:
    """The compiled library's path, compiling it first unless a process already did (same source, flags, CPU)."""
    cxx, source = cxx_compiler(), SOURCE.read_bytes()
    if not cxx:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++)")
    key = hashlib.sha256(b"\0".join([source, " ".join(BUILD_FLAGS).encode(), cxx.encode(), _cpu_identity()]))
    lib = Path(sglite_cache_dir("kernels")) / f"small_m_linear-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib  # loading does not touch its mtime: pruning ranks libraries by when they were built
    t0 = time.perf_counter()
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.{threading.get_ident()}")
    proc = subprocess.run([cxx, *BUILD_FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-500:]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's library is the same; whichever lands last stays
    logger.info("CPU small-M kernel: compiled in %.1f s into %s", time.perf_counter() - t0, lib)
    _prune_old_libraries(lib)
    return lib


def _prune_old_libraries(keep: Path) -> None:
    """Delete all but the KEPT_LIBRARIES newest built libraries beside ``keep`` (which always stays).

    A process that still has a deleted library mapped keeps using it (POSIX unlink semantics); a later start
    that needs it again rebuilds it (~3 s).
    """
    built = sorted(keep.parent.glob("small_m_linear-*.so"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    stale = [p for p in built if p != keep][KEPT_LIBRARIES - 1 :]
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        logger.info("CPU small-M kernel: removed %d older libraries from %s", len(stale), keep.parent)


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
