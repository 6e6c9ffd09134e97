"""A C++ CPU kernel for the compiled forwards' paged causal attention (csrc/paged_attention.cpp): ``sglite::paged_attention``.

Traced by Inductor, the torch formulation (``compiled_decode.paged_causal_attention``) scores every key of the longest
sequence for each new token, and each prompt token re-reads its request's keys: ~5% of a prefill of 32 prompts of 32
tokens on SmolLM2, and a 1,024-token prompt took 1.9x as long as with this kernel (docs/benchmarks.md, "A paged
attention kernel for prefills, mixed steps and verify blocks"). The kernel reads each key row once per new token for
all query heads that share it and scores only the causal range. The compiled token graph (prefills, mixed steps,
verify blocks) calls it; the decode graph keeps the torch formulation, which Inductor runs as fast there. It is plain
C++ built on first use into sglite's kernel cache and called through ctypes (layers/cpu_kernel_build.py), inside the
compiled graph as one opaque op. It serves fp32 with the head sizes in ``HEAD_DIMS`` and up to ``MAX_GROUP`` query
heads per KV head; otherwise, on a non-x86 host, or with ``SGLITE_CPU_PAGED_ATTENTION_KERNEL=0`` (A/Bs), the torch
formulation runs.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Optional

import torch

from sglite.srt.layers.cpu_kernel_build import BASE_FLAGS, CSRC, open_cpu_library

SOURCE = CSRC / "paged_attention.cpp"
ENV_SWITCH = "SGLITE_CPU_PAGED_ATTENTION_KERNEL"
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the kernel's instantiations
MAX_GROUP = 16  # query heads per KV head
_BUILD_LOCK = threading.Lock()


def start_building_paged_attention_kernel() -> None:
    """Build (or load) the kernel in a background thread, so a first start compiles it while the weights load."""
    threading.Thread(target=_library, name="sglite-paged-attention-build", daemon=True).start()


def _library() -> Optional[ctypes.CDLL]:
    with _BUILD_LOCK:
        return _load_library()


@functools.cache
def _load_library() -> Optional[ctypes.CDLL]:
    lib = open_cpu_library(
        SOURCE, BASE_FLAGS, ENV_SWITCH, "CPU paged attention kernel", "compiled forwards use the torch formulation"
    )
    if lib is None:
        return None
    fn = lib.sglite_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    return lib


def kernel_serves(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int) -> bool:
    """Whether the kernel is built here and serves attention of this dtype and head geometry (a layer's, fixed)."""
    shapes_fit = (
        dtype == torch.float32
        and num_kv_heads >= 1
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim in HEAD_DIMS
        and v_head_dim in HEAD_DIMS
    )
    return shapes_fit and _library() is not None


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor, seq_lens: torch.Tensor,
    token_rows: Optional[torch.Tensor], token_key_index: Optional[torch.Tensor], scaling: float, sliding_window: int,
) -> torch.Tensor:
    """o ``[T, H, Dv]``: ``compiled_decode.paged_causal_attention``'s contract, through the kernel (0: no window)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged attention kernel is not built; callers check kernel_serves first")
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = v_cache.shape[1], v_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == torch.float32):
        raise ValueError("paged_attention: the K/V pool buffers must be contiguous fp32 [slots, kv heads, head dim]")
    q = q.contiguous()
    kv_indices, seq_lens = kv_indices.contiguous(), seq_lens.contiguous()
    token_rows = None if token_rows is None else token_rows.contiguous()
    token_key_index = None if token_key_index is None else token_key_index.contiguous()
    out = q.new_empty((tokens, num_heads, v_head_dim))
    status = lib.sglite_paged_attention(
        q.data_ptr(), tokens, num_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(), num_kv_heads, v_head_dim,
        kv_indices.data_ptr(), kv_indices.shape[0], kv_indices.stride(0), seq_lens.data_ptr(), _ptr(token_rows),
        _ptr(token_key_index), scaling, sliding_window, out.data_ptr(),
    )
    if status != 0:
        raise ValueError(
            f"paged_attention kernel refused its inputs (status {status}): q {tuple(q.shape)}, "
            f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}, {kv_indices.shape[0]} requests"
        )
    return out


def _paged_attention_fake(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor, seq_lens: torch.Tensor,
    token_rows: Optional[torch.Tensor], token_key_index: Optional[torch.Tensor], scaling: float, sliding_window: int,
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[2]))


# A plain Library fragment (the namespace is cpu_gemm's): torch.library.custom_op's wrapper costs ~50 us a call.
_LIB = torch.library.Library("sglite", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indices, Tensor seq_lens, Tensor? token_rows, "
    "Tensor? token_key_index, float scaling, int sliding_window) -> Tensor"
)
_LIB.impl("paged_attention", _paged_attention, "CPU")
torch.library.register_fake("sglite::paged_attention", _paged_attention_fake, lib=_LIB)
