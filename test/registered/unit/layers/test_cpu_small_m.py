"""cpu_small_m: the 2-16 row kernel gives F.linear's products on row- and column-major weights, and cpu_gemm routes to it."""

import os
import shutil

import pytest
import torch

from sglite.srt.layers import cpu_gemm, cpu_small_m
from sglite.srt.layers.cpu_small_m import SMALL_M_MAX_ROWS, SMALL_M_MIN_ROWS, small_m_kernel, small_m_linear
from sglite.testing.fp32_reference import assert_same_dot_products

SUITE = "unit-cpu"
EST_TIME = 15  # two compiles of the kernel (~3 s each) and ~180 small products

pytestmark = pytest.mark.skipif(
    cpu_small_m.cxx_compiler() is None or not torch.backends.mkldnn.is_available(), reason="needs a C++ compiler and an x86 torch build"
)


def column_major(out_features: int, in_features: int) -> torch.Tensor:
    """An [out, in] weight stored as the transpose of a contiguous [in, out] tensor (layers/utils.new_weight_matrix)."""
    return torch.randn(in_features, out_features).t()


def test_the_kernel_builds_where_a_compiler_exists():
    assert small_m_kernel() is not None


# N covers the 4-row blocks, the 16-column vectors and the 256-column thread chunks with and without tails;
# K covers the 16-lane vectors and the 8 k-rows per pass with and without tails.
@pytest.mark.parametrize("rows", range(SMALL_M_MIN_ROWS, SMALL_M_MAX_ROWS + 1))
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
    assert small_m_linear(torch.randn(0, 16), w, None) is None  # no rows
    assert small_m_linear(torch.randn(SMALL_M_MAX_ROWS + 1, 16), w, None) is None  # the packs' range
    assert small_m_linear(torch.randn(4, 16, dtype=torch.float64), w.double(), None) is None
    assert small_m_linear(torch.randn(4, 16, requires_grad=True), w, None) is None  # no autograd in the kernel
    assert small_m_linear(torch.randn(4, 16), torch.randn(16, 64)[:, ::2], None) is None  # neither layout


def test_the_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(cpu_small_m.ENV_SWITCH, "0")
    cpu_small_m._load_kernel.cache_clear()
    try:
        assert small_m_kernel() is None
        assert small_m_linear(torch.randn(4, 16), column_major(32, 16), None) is None
    finally:
        cpu_small_m._load_kernel.cache_clear()


def test_an_untimed_packed_weight_routes_every_count_the_kernel_covers_to_it(monkeypatch):
    calls = []
    real = cpu_gemm.small_m_linear

    def spy(x, weight, bias):
        out = real(x, weight, bias)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_gemm, "small_m_linear", spy)
    w = column_major(64, 32)
    packed = cpu_gemm.PackedWeight(cpu_gemm.pack_weight(w, cpu_gemm.available_pack_layouts()[0]))
    for rows, by_kernel in [(1, None), (2, True), (SMALL_M_MAX_ROWS, True), (SMALL_M_MAX_ROWS + 1, None)]:
        calls.clear()
        x = torch.randn(rows, 32)
        assert_same_dot_products(cpu_gemm.linear(x, w, None, packed), x, w)
        assert calls == ([] if by_kernel is None else [True] if by_kernel else [False])


def test_the_library_lives_in_sglites_cache_keyed_by_source_and_host(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    lib = cpu_small_m._build()
    assert lib.parent == tmp_path / "kernels" and lib.name.startswith("small_m_linear-") and lib.exists()
    built_at = lib.stat().st_mtime_ns
    assert cpu_small_m._build() == lib and lib.stat().st_mtime_ns == built_at  # a second process loads it as is
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temporary file left behind


def test_a_build_keeps_only_the_newest_libraries(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    old = [kernels / f"small_m_linear-{i:016x}.so" for i in range(cpu_small_m.KEPT_LIBRARIES + 2)]
    for age, path in enumerate(old):  # old[0] newest, old[-1] oldest, all older than the build below
        path.write_bytes(b"stale")
        os.utime(path, ns=(1_000_000_000 * (1000 - age),) * 2)
    unrelated = kernels / "other-kernel.so"
    unrelated.write_bytes(b"not ours")
    lib = cpu_small_m._build()
    kept = sorted(p.name for p in kernels.glob("small_m_linear-*.so"))
    assert kept == sorted([lib.name] + [p.name for p in old[: cpu_small_m.KEPT_LIBRARIES - 1]])
    assert unrelated.exists()  # only the kernel's own libraries are pruned


def test_a_failed_build_is_a_warning_and_the_packs_serve(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    cpu_small_m._load_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_small_m.__name__):
            assert small_m_kernel() is None
        assert "CPU small-M kernel not built" in caplog.text and "failed" in caplog.text
        assert not list((tmp_path / "kernels").iterdir())
    finally:
        cpu_small_m._load_kernel.cache_clear()


def test_the_kernel_refuses_what_it_cannot_read():
    kernel = small_m_kernel()
    with pytest.raises(ValueError, match="rows contiguous"):
        kernel(torch.randn(SMALL_M_MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="fp32"):
        kernel(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="row- or column-major"):
        kernel(torch.randn(2, 8), torch.randn(4, 16)[:, ::2])
