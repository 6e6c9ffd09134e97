"""cpu_kernel_build: a kernel library's build key covers the shared headers beside its source."""

import shutil

import pytest

from sglite.srt.layers.cpu_kernel_build import BASE_FLAGS, CSRC, build_cpu_library, cxx_compiler

SUITE = "unit-cpu"
EST_TIME = 10  # two builds of the small-M kernel (~3 s each)


@pytest.mark.skipif(cxx_compiler() is None, reason="needs a C++ compiler")
def test_a_header_change_rebuilds_the_kernels_that_include_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(CSRC / "small_m_linear.cpp", src)
    shutil.copy(CSRC / "vec16.h", src)
    first = build_cpu_library(src / "small_m_linear.cpp", BASE_FLAGS)
    assert build_cpu_library(src / "small_m_linear.cpp", BASE_FLAGS) == first  # same sources: loaded as built
    with open(src / "vec16.h", "a") as f:
        f.write("\n// a changed header\n")
    second = build_cpu_library(src / "small_m_linear.cpp", BASE_FLAGS)
    assert second != first and second.exists() and first.exists()


def test_cpu_flags_are_the_flags_lines_of_cpuinfo(monkeypatch):
    from sglite.srt.layers import cpu_kernel_build

    lines = ["processor\t: 0", "flags\t\t: fpu avx512f avx512_bf16", "processor\t: 1", "flags\t\t: fpu avx512f avx512_bf16"]
    monkeypatch.setattr(cpu_kernel_build, "_cpuinfo_lines", lambda: lines)
    assert cpu_kernel_build.cpu_flags() == frozenset({"fpu", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(cpu_kernel_build, "_cpuinfo_lines", lambda: None)  # no /proc/cpuinfo: nothing to claim
    assert cpu_kernel_build.cpu_flags() == frozenset()
