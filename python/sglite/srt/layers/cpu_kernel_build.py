"""Building sglite's own C++ CPU kernels (layers/csrc/*.cpp) into shared libraries loaded with ctypes.

Each kernel is plain C++ with a C entry point (no torch headers: ~3 s to compile instead of ~25), built on first
use with the host's compiler (``$CXX``, else ``c++`` or ``g++``) into sglite's cache (``$SGLITE_CACHE_DIR``, else
``~/.cache/sglite``, under ``kernels/``). A library's name is its source's stem and a hash of source (with the
shared headers beside it), flags, compiler and CPU (``-march=native`` builds for the CPU), so later processes on the
same host load it as built. OpenMP comes from torch's own ``libgomp.so.1`` (same soname, already loaded), so the
kernels share torch's thread pool and its ``set_num_threads``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

from sglite.srt.configs.cache_dir import sglite_cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Libraries kept in the cache per kernel: the newest built ones, by mtime (one per source version, compiler and CPU
# that shares the cache dir); older ones are deleted after a build, so upgrades do not pile up files forever.
KEPT_LIBRARIES = 4


def cxx_compiler() -> Optional[str]:
    """The compiler kernels are built with: ``$CXX``, else ``c++`` or ``g++`` on PATH (None when there is none)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpuinfo_lines() -> Optional[list[str]]:
    """/proc/cpuinfo's lines (None where there is none: not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags as /proc/cpuinfo lists them (``avx512_bf16``, ...); empty where it cannot say."""
    lines = _cpuinfo_lines() or []
    return frozenset(flag for ln in lines if ln.startswith("flags") for flag in ln.partition(":")[2].split())


def _cpu_identity() -> bytes:
    """The host CPU's model and feature flags (-march=native builds for them), where /proc/cpuinfo says."""
    lines = _cpuinfo_lines()
    if lines is None:
        return platform.processor().encode()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def build_cpu_library(source: Path, flags: tuple[str, ...]) -> Path:
    """The compiled library of ``source``, compiling it first unless a process already did (same source, flags, CPU)."""
    cxx, text = cxx_compiler(), source.read_bytes()
    if not cxx:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++)")
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # the kernels' shared headers (vec16.h)
    key = hashlib.sha256(b"\0".join([text, *headers, " ".join(flags).encode(), cxx.encode(), _cpu_identity()]))
    lib = Path(sglite_cache_dir("kernels")) / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib  # loading does not touch its mtime: pruning ranks libraries by when they were built
    t0 = time.perf_counter()
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.{threading.get_ident()}")
    proc = subprocess.run([cxx, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-500:]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's library is the same; whichever lands last stays
    logger.info("CPU kernel %s: compiled in %.1f s into %s", source.stem, time.perf_counter() - t0, lib)
    _prune_old_libraries(lib, source.stem)
    return lib


def _prune_old_libraries(keep: Path, stem: str) -> None:
    """Delete all but the KEPT_LIBRARIES newest built libraries of ``stem`` beside ``keep`` (which always stays).

    A process that still has a deleted library mapped keeps using it (POSIX unlink semantics); a later start
    that needs it again rebuilds it (~3 s).
    """
    built = sorted(keep.parent.glob(f"{stem}-*.so"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    stale = [p for p in built if p != keep][KEPT_LIBRARIES - 1 :]
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        logger.info("CPU kernel %s: removed %d older libraries from %s", stem, len(stale), keep.parent)


def open_cpu_library(source: Path, flags: tuple[str, ...], env_switch: str, what: str, instead: str) -> Optional[ctypes.CDLL]:
    """The kernel's library, or None: switched off (``env_switch=0``), not x86, or not built (a warning that says
    ``instead`` serves)."""
    if os.environ.get(env_switch, "1") == "0":
        logger.info("%s: off (%s=0)", what, env_switch)
        return None
    if platform.machine() not in ("x86_64", "AMD64"):  # the vector code and -march=native assume x86
        return None
    try:
        return ctypes.CDLL(str(build_cpu_library(source, flags)))
    except Exception as e:  # no compiler, a failed build: another path serves these products
        logger.warning("%s not built (%s); %s", what, e, instead)
        return None
