"""Test-wide setup: Triton's interpreter on CPU-only hosts, set before any kernel module is imported."""

import os
import sys

# TRITON_INTERPRET is read when @triton.jit decorates a kernel, so it must be set before
# sglite's kernel modules are imported; on a GPU host the compiled kernels are used.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(_repo, "python"), _repo):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# GGUF metadata folders (sglite.srt.configs.gguf) go to a throwaway cache, not the user's ~/.cache;
# run_suite.py sets one folder for the whole run so files share the conversion, servers inherit it.
if not os.environ.get("SGLITE_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["SGLITE_CACHE_DIR"] = tempfile.mkdtemp(prefix="sglite_test_cache_")
    atexit.register(shutil.rmtree, os.environ["SGLITE_CACHE_DIR"], True)
