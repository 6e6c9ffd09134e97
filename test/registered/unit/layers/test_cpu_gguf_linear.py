"""cpu_gguf_linear: the GGUF block kernel dequantizes exactly as the gguf package does, gives the fp32 weights'
products up to summation order, sums each output in one order whatever the row count, and refuses what it cannot read."""

import gguf
import numpy as np
import pytest
import torch

from sglite.srt.layers import cpu_gguf_linear
from sglite.srt.layers.cpu_gguf_linear import (
    GGUF_LINEAR_TYPES,
    GGUF_MAX_ROWS,
    gguf_dequantize,
    gguf_kernel_available,
    gguf_linear,
    gguf_weight_from_rows,
)
from sglite.srt.layers.cpu_kernel_build import cxx_compiler
from sglite.testing.fp32_reference import assert_same_dot_products

SUITE = "unit-cpu"
EST_TIME = 25  # four compiles of the kernel (~3 s each: native, scalar, AVX2, AVX-512) and ~400 small products

pytestmark = pytest.mark.skipif(cxx_compiler() is None, reason="needs a C++ compiler")
TYPES = {name: type_id for type_id, (name, _) in GGUF_LINEAR_TYPES.items()}


def quantized(out_features: int, in_features: int, type_name: str, seed: int = 0):
    """Random weights quantized by the gguf package: (GGUFWeight, the package's own fp32 dequantization)."""
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((out_features, in_features)) * 0.5).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(data, qtype)
    weight = gguf_weight_from_rows(torch.from_numpy(np.ascontiguousarray(blocks)), TYPES[type_name], in_features)
    return weight, torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, qtype)))


def test_the_kernel_builds_where_a_compiler_exists():
    assert gguf_kernel_available()


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_dequantize_is_bit_equal_to_the_gguf_package(type_name):
    weight, reference = quantized(67, 96, type_name)
    assert torch.equal(gguf_dequantize(weight), reference)


# N covers the 4- and 2-row blocks of W with and without tails; K one block and several.
@pytest.mark.parametrize("rows", range(1, GGUF_MAX_ROWS + 1))
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (7, 64), (300, 576), (61, 1536)])
@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_products_equal_the_dequantized_weights_products(rows, out_features, in_features, type_name):
    weight, w = quantized(out_features, in_features, type_name, seed=rows)
    x = torch.randn(rows, in_features)
    assert_same_dot_products(gguf_linear(x, weight.blocks, weight.ggml_type, None), x, w)


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_each_row_is_summed_in_one_order_whatever_the_row_count(type_name):
    """A DFLASH verify (5 rows a request) scores a row exactly as a decode step (1 row) would."""
    weight, _ = quantized(131, 576, type_name, seed=3)
    x = torch.randn(GGUF_MAX_ROWS, 576)
    singles = torch.cat([gguf_linear(x[m : m + 1], weight.blocks, weight.ggml_type, None) for m in range(GGUF_MAX_ROWS)])
    for rows in range(1, GGUF_MAX_ROWS + 1):
        assert torch.equal(gguf_linear(x[:rows], weight.blocks, weight.ggml_type, None), singles[:rows]), rows


def test_leading_dims_strided_rows_and_the_bias():
    weight, w = quantized(48, 64, "Q4_1")
    wide, b = torch.randn(1, 5, 80), torch.randn(48)
    x = wide[..., 8:72]  # rows 80 floats apart, each contiguous
    got = gguf_linear(x, weight.blocks, weight.ggml_type, b)
    assert got.shape == (1, 5, 48)
    assert_same_dot_products(got[0], x[0], w, b)


def test_what_the_kernel_does_not_serve_returns_none():
    weight, _ = quantized(16, 32, "Q8_0")
    assert gguf_linear(torch.randn(GGUF_MAX_ROWS + 1, 32), weight.blocks, weight.ggml_type, None) is None
    assert gguf_linear(torch.randn(2, 32, dtype=torch.float64), weight.blocks, weight.ggml_type, None) is None
    with torch.enable_grad():
        assert gguf_linear(torch.randn(2, 32, requires_grad=True), weight.blocks, weight.ggml_type, None) is None


def test_blocks_it_cannot_read_are_refused():
    blocks = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not one the GGUF linear kernel reads"):
        gguf_weight_from_rows(blocks, int(gguf.GGMLQuantizationType.Q5_0), 32)
    with pytest.raises(ValueError, match="do not hold 64 weights"):
        gguf_weight_from_rows(blocks, TYPES["Q4_1"], 64)
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_weight_from_rows(blocks, TYPES["Q4_1"], 40)


def test_switched_off_the_kernel_is_not_offered(monkeypatch):
    monkeypatch.setenv(cpu_gguf_linear.ENV_SWITCH, "0")
    cpu_gguf_linear._open.cache_clear()
    try:
        assert not gguf_kernel_available()
        weight, _ = quantized(8, 32, "Q8_0")
        assert gguf_linear(torch.randn(1, 32), weight.blocks, weight.ggml_type, None) is None
    finally:
        cpu_gguf_linear._open.cache_clear()


def _host_has(*cpu_flags: str) -> bool:
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return all(f in flags for f in cpu_flags)


# Each build the source has (scalar, AVX2, AVX-512), with the -march that selects it and the CPU flags it needs.
BUILDS = {
    "scalar": ("-march=x86-64", ()),
    "avx2": ("-march=haswell", ("avx2", "fma", "f16c")),
    "avx512": ("-march=x86-64-v4", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c")),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_build_sums_in_the_native_builds_order(build, tmp_path, monkeypatch):
    """A host without AVX2 builds the scalar loop, an AVX2 host the 8-lane one, an AVX-512 host the 16-lane one:
    their products are bit-equal to the native build's, so a 16-lane accumulator holds the same 16 partial sums."""
    import ctypes

    from sglite.srt.layers.cpu_kernel_build import build_cpu_library

    march, needs = BUILDS[build]
    if not _host_has(*needs):
        pytest.skip(f"this CPU lacks {', '.join(needs)}")
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    flags = tuple(f for f in cpu_gguf_linear.BUILD_FLAGS if f != "-march=native") + (march,)
    lib = ctypes.CDLL(str(build_cpu_library(cpu_gguf_linear.SOURCE, flags)))
    for type_name in sorted(TYPES):
        weight, _ = quantized(37, 96, type_name, seed=7)
        for rows in (1, 2, 5, 9, 12, 13, 16):
            x = torch.randn(rows, 96)
            got = torch.empty(rows, 37)
            assert lib.sglite_gguf_linear(
                ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(96), ctypes.c_void_p(weight.blocks.data_ptr()),
                ctypes.c_int64(37), ctypes.c_int64(96), ctypes.c_void_p(got.data_ptr()), ctypes.c_int64(rows),
                ctypes.c_int(weight.ggml_type),
            ) == 0
            assert torch.equal(got, gguf_linear(x, weight.blocks, weight.ggml_type, None)), (type_name, rows)
