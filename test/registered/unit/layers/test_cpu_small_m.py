"""cpu_small_m: the 2-16 row kernel gives F.linear's products on row- and column-major weights, and cpu_gemm routes to it."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from sglite.srt.layers import cpu_gemm, cpu_small_m
from sglite.srt.layers.cpu_small_m import SMALL_M_MAX_ROWS, SMALL_M_MIN_ROWS, small_m_kernel, small_m_linear

SUITE = "unit-cpu"
EST_TIME = 30  # the first run on a host builds the kernel (~25 s); later ones load torch's cached build

HAS_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(
    not (HAS_CXX and torch.backends.mkldnn.is_available()), reason="needs a C++ compiler and an x86 torch build"
)


def assert_same_dot_products(got, x, w, b=None):
    """got == x @ w.T (+ b) up to summation order (Higham's bound, twice, for two orders)."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    terms = x.abs().double() @ w.abs().double().t() + (0 if b is None else b.abs().double())
    bound = 2 * (x.shape[-1] + 1) * 2.0**-24 * terms
    assert got.shape == want.shape
    assert bool(((got.double() - want).abs() <= bound).all())


def column_major(out_features: int, in_features: int) -> torch.Tensor:
    """An [out, in] weight stored as the transpose of a contiguous [in, out] tensor (layers/utils.new_weight_matrix)."""
    return torch.randn(in_features, out_features).t()


def test_the_kernel_builds_where_a_compiler_exists():
    assert small_m_kernel() is not None


# N covers the 4-row blocks, the 16-column vectors and the 256-column thread chunks with and without tails;
# K covers the 16-lane vectors and the 8 k-rows per pass with and without tails.
@pytest.mark.parametrize("rows", range(1, SMALL_M_MAX_ROWS + 1))
@pytest.mark.parametrize("out_features,in_features", [(7, 33), (16, 16), (300, 576), (576, 1536), (1031, 5)])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_kernel_equals_f_linear(rows, out_features, in_features, layout):
    torch.manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features) if layout == "row-major" else column_major(out_features, in_features)
    x = torch.randn(rows, in_features)
    assert_same_dot_products(small_m_kernel()(x, w), x, w)


def test_kernel_reads_strided_rows_of_x():
    wide = torch.randn(5, 80)
    x = wide[:, 8:72]  # rows 80 floats apart, each contiguous
    w = column_major(40, 64)
    assert_same_dot_products(small_m_kernel()(x, w), x, w)


def test_small_m_linear_keeps_leading_dims_and_adds_the_bias():
    x, w, b = torch.randn(1, 5, 64), column_major(48, 64), torch.randn(48)
    assert_same_dot_products(small_m_linear(x, w, b), x, w, b)


def test_small_m_linear_declines_what_the_kernel_does_not_cover():
    w = column_major(32, 16)
    assert small_m_linear(torch.randn(SMALL_M_MIN_ROWS - 1, 16), w, None) is None  # a gemv
    assert small_m_linear(torch.randn(SMALL_M_MAX_ROWS + 1, 16), w, None) is None  # the packs' range
    assert small_m_linear(torch.randn(4, 16, dtype=torch.float64), w.double(), None) is None
    assert small_m_linear(torch.randn(4, 16, requires_grad=True), w, None) is None  # no autograd in the kernel
    assert small_m_linear(torch.randn(4, 16), torch.randn(16, 64)[:, ::2], None) is None  # neither layout


def test_the_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(cpu_small_m.ENV_SWITCH, "0")
    small_m_kernel.cache_clear()
    try:
        assert small_m_kernel() is None
        assert small_m_linear(torch.randn(4, 16), column_major(32, 16), None) is None
    finally:
        small_m_kernel.cache_clear()


def test_cpu_gemm_routes_two_to_eight_rows_to_the_kernel(monkeypatch):
    calls = []
    real = cpu_gemm.small_m_linear

    def spy(x, weight, bias):
        out = real(x, weight, bias)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_gemm, "small_m_linear", spy)
    w = column_major(64, 32)
    packed = cpu_gemm.pack_weight(w, cpu_gemm.available_pack_layouts()[0])
    for rows, by_kernel in [(1, None), (2, True), (SMALL_M_MAX_ROWS, True), (SMALL_M_MAX_ROWS + 1, False)]:
        calls.clear()
        x = torch.randn(rows, 32)
        assert_same_dot_products(cpu_gemm.linear(x, w, None, packed), x, w)
        assert calls == ([] if by_kernel is None else [True] if by_kernel else [False])
