"""GPU suite: compiled Triton kernels (and flashinfer when installed) equal torch_native on CUDA, bf16 included."""

SUITE = "gpu"
EST_TIME = 150

import importlib.util
import itertools

import pytest
import torch

from attention_cases import build_case, dense_reference, run_backend
from sglite.srt.model_executor.forward_batch_info import ForwardMode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK]
GQA = [(8, 1), (2, 4), (1, 8)]
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),  # IEEE fp32 dots (not tf32)
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),  # P is rounded to bf16 before the P@V dot
}


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    """One fixed config per kernel variant (one compile each); test_autotuned_* turn autotuning back on."""
    monkeypatch.setenv("SGLITE_TRITON_AUTOTUNE", "0")


def lens_for(mode: ForwardMode) -> tuple[list[int], list[int]]:
    """Ragged, longer than the CPU cases: several kernel blocks and decode splits per request."""
    if mode == ForwardMode.DECODE:
        return [0, 1, 517, 2048, 3001], [1] * 5
    if mode == ForwardMode.EXTEND:
        return [0, 300, 1500, 17], [700, 129, 1, 1024]
    return [5, 900, 2047, 64], [16] * 4


def _backend(name: str):
    if name == "triton":
        from sglite.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    from types import SimpleNamespace

    from sglite.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(SimpleNamespace(device=torch.device("cuda")))


def _check(backend_name, mode, page_size, num_kv_heads, group, head_dim, dtype, sliding_window=None, v_head_dim=None, kv_dtype=None):
    from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    prefix, extend = lens_for(mode)
    kw = dict(page_size=page_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, v_head_dim=v_head_dim,
              dtype=dtype, kv_dtype=kv_dtype, device="cuda", seed=page_size + group, sliding_window=sliding_window)
    ref = run_backend(TorchNativeAttnBackend(), build_case(mode, prefix, extend, **kw))
    out = run_backend(_backend(backend_name), build_case(mode, prefix, extend, **kw))
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# bf16 over the full product; fp16 / fp32 over one page size and GQA ratio (each new dtype, head dim
# and mask kind compiles a fresh kernel variant, which dominates this file's time).
CASES = list(itertools.product(MODES, [1, 16], GQA, [64, 128], [torch.bfloat16])) + list(
    itertools.product(MODES, [16], [GQA[1]], [64, 128], [torch.float16, torch.float32])
)


@pytest.mark.parametrize(
    "mode,page_size,gqa,head_dim,dtype", CASES,
    ids=[f"{m.name}-ps{p}-g{g[1]}-d{d}-{str(t)[6:]}" for m, p, g, d, t in CASES],
)
def test_triton_equals_torch_native_cuda(mode, page_size, gqa, head_dim, dtype):
    _check("triton", mode, page_size, gqa[0], gqa[1], head_dim, dtype)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_triton_sliding_window_and_v_head_dim_cuda(mode):
    _check("triton", mode, 16, 2, 4, 128, torch.bfloat16, sliding_window=300)
    _check("triton", mode, 1, 2, 4, 128, torch.bfloat16, v_head_dim=64)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_autotuned_triton_equals_torch_native_cuda(mode, monkeypatch):
    monkeypatch.setenv("SGLITE_TRITON_AUTOTUNE", "1")
    _check("triton", mode, 16, 2, 4, 128, torch.bfloat16)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_triton_fp8_kv_cache_cuda(mode):
    _check("triton", mode, 16, 2, 4, 128, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)


def test_torch_native_equals_dense_cuda():
    case = build_case(ForwardMode.EXTEND, [0, 300], [200, 50], page_size=16, num_kv_heads=2, group=4, head_dim=128, device="cuda")
    from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    out = run_backend(TorchNativeAttnBackend(), case)
    torch.testing.assert_close(out, dense_reference(case, causal=True), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("sliding_window", [None, 300])
def test_flashinfer_equals_torch_native_cuda(mode, sliding_window):
    _check("flashinfer", mode, 16, 2, 4, 128, torch.bfloat16, sliding_window=sliding_window)
