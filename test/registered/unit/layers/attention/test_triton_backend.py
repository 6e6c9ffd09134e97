"""Triton attention kernels (interpreter on CPU) equal the torch_native reference on random paged layouts."""

SUITE = "unit-cpu"
EST_TIME = 90

import itertools

import pytest
import torch

from attention_cases import build_case, run_backend
from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.srt.layers.attention.triton_backend import TritonAttnBackend
from sglite.srt.model_executor.forward_batch_info import ForwardMode

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK]
# (num_kv_heads, group): GQA ratios 1, 4, 8 with few heads to keep interpreter grids small.
GQA = [(2, 1), (1, 4), (1, 8)]


def lens_for(mode: ForwardMode, seed: int) -> tuple[list[int], list[int]]:
    """Ragged prefixes (one empty, one crossing several 16-token pages and kernel blocks)."""
    if mode == ForwardMode.DECODE:
        return [1, 40 + seed, 150], [1, 1, 1]
    if mode == ForwardMode.EXTEND:
        return [0, 37 + seed, 70], [70, 9, 13]
    return [3, 80 + seed, 21], [8, 8, 8]  # VERIFY / DRAFT_BLOCK: block size 8


def tolerance(dtype: torch.dtype) -> dict:
    # fp16: both sides compute in fp32 from the same fp16 inputs; only the fp16 output rounding differs.
    return dict(atol=1e-3, rtol=1e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)


def check_equal(mode, page_size, num_kv_heads, group, head_dim, dtype, seed, backend_kw=None, lens=None, **kw):
    prefix, extend = lens or lens_for(mode, seed)
    common = dict(page_size=page_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype, seed=seed, **kw)
    ref = run_backend(TorchNativeAttnBackend(), build_case(mode, prefix, extend, **common))
    out = run_backend(TritonAttnBackend(**(backend_kw or {})), build_case(mode, prefix, extend, **common))
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **tolerance(dtype))


# The full product: modes x page sizes x GQA ratios x head dims x dtypes (~0.5 s each in the interpreter).
CASES = [
    (mode, ps, kvh, g, d, dt, i % 7)
    for i, (mode, ps, (kvh, g), d, dt) in enumerate(
        itertools.product(MODES, [1, 16], GQA, [64, 128], [torch.float32, torch.float16])
    )
]


@pytest.mark.parametrize(
    "mode,page_size,num_kv_heads,group,head_dim,dtype,seed",
    CASES,
    ids=[f"{c[0].name}-ps{c[1]}-g{c[3]}-d{c[4]}-{str(c[5])[6:]}" for c in CASES],
)
def test_triton_equals_torch_native(mode, page_size, num_kv_heads, group, head_dim, dtype, seed):
    check_equal(mode, page_size, num_kv_heads, group, head_dim, dtype, seed)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_triton_sliding_window(mode):
    check_equal(mode, 16, 1, 4, 64, torch.float32, 5, sliding_window=20)


# VERIFY / DRAFT_BLOCK blocks (8 tokens) go to the split-K kernel by default; these run them through
# the extend kernel instead (split_block_max=0), so both kernels see causal and non-causal blocks.
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK], ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 8)])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_blocks_through_extend_kernel(mode, page_size, num_kv_heads, group, sliding_window):
    check_equal(mode, page_size, num_kv_heads, group, 64, torch.float32, 6, backend_kw={"split_block_max": 0}, sliding_window=sliding_window)


@pytest.mark.parametrize("group,sliding_window", [(1, None), (8, 9)])
def test_short_ragged_extend_through_split_kernel(group, sliding_window):
    """An EXTEND whose requests add 1..32 tokens (ragged) takes the split-K path."""
    check_equal(ForwardMode.EXTEND, 16, 1, group, 64, torch.float32, 8, lens=([0, 45, 3], [17, 1, 32]), sliding_window=sliding_window)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_triton_v_head_dim_differs(mode):
    check_equal(mode, 1, 2, 2, 64, torch.float32, 7, v_head_dim=32)


@pytest.mark.parametrize("mode,extend", [(ForwardMode.DECODE, 1), (ForwardMode.DRAFT_BLOCK, 4)], ids=["DECODE", "DRAFT_BLOCK"])
def test_split_counts_agree(mode, extend):
    """Split-K gives the same result for 1, 3 and 8 splits (empty splits included)."""
    outs = []
    for splits in (1, 3, 8):
        case = build_case(mode, [2, 60], [extend, extend], page_size=16, num_kv_heads=1, group=4, head_dim=64, seed=11)
        outs.append(run_backend(TritonAttnBackend(num_kv_splits=splits), case))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-5, rtol=1e-5)


def test_triton_writes_new_kv_and_honours_save_kv_cache_false():
    case = build_case(ForwardMode.TARGET_VERIFY, [5, 9], [4, 4], page_size=1, num_kv_heads=1, group=2, head_dim=64)
    first = run_backend(TritonAttnBackend(), case)
    k_buf = case.forward_batch.token_to_kv_pool.get_key_buffer(case.layer.layer_id)
    torch.testing.assert_close(k_buf[case.forward_batch.out_cache_loc].reshape(case.k.shape), case.k)
    case.k = torch.zeros_like(case.k)
    torch.testing.assert_close(run_backend(TritonAttnBackend(), case, save_kv_cache=False), first)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_triton_fp8_kv_cache(mode, kv_dtype):
    """FP8 pools are upcast on load; the reference reads the same quantized values."""
    check_equal(mode, 16, 1, 4, 64, torch.float16, 9, kv_dtype=kv_dtype)


def test_q_start_buffer_is_reused_in_place():
    """Extend metadata is written into one persistent buffer (what a captured CUDA graph reads)."""
    backend = TritonAttnBackend()
    backend.reserve(8)
    buf = backend._q_start_buf
    for seed, extend in enumerate(([3, 5, 2], [4, 4])):
        case = build_case(ForwardMode.TARGET_VERIFY if len(set(extend)) == 1 else ForwardMode.EXTEND, [1] * len(extend), extend,
                          page_size=1, num_kv_heads=1, group=1, head_dim=16, seed=seed)
        backend.init_forward_metadata(case.forward_batch)
        assert backend.metadata.q_start.data_ptr() == buf.data_ptr()
        assert backend.metadata.q_start.tolist() == [sum(extend[:i]) for i in range(len(extend))]


def test_split_scratch_is_one_grow_only_buffer():
    """Split-K scratch is reused across batches; an outgrown buffer stays alive (captured graphs may use it)."""
    backend = TritonAttnBackend()
    small = build_case(ForwardMode.DECODE, [3], [1], page_size=1, num_kv_heads=1, group=2, head_dim=16)
    big = build_case(ForwardMode.TARGET_VERIFY, [3, 5], [4, 4], page_size=1, num_kv_heads=1, group=2, head_dim=16)
    run_backend(backend, small)
    first = backend._scratch_buf
    run_backend(backend, big)
    grown = backend._scratch_buf
    assert grown.numel() > first.numel() and backend._retired_scratch == [first]
    run_backend(backend, small)
    assert backend._scratch_buf is grown
