"""Bf16Projection: a wide fp32 projection through a bf16 copy of the weight, and when the host runs it natively."""

import pytest
import torch
import torch.nn.functional as F

from sglite.srt.layers import cpu_bf16_projection
from sglite.srt.layers.cpu_bf16_projection import Bf16Projection, bf16_gemm_is_native
from sglite.srt.layers.cpu_gemm import available_pack_layouts

SUITE = "unit-cpu"
EST_TIME = 1

needs_bf16_pack = pytest.mark.skipif(
    "onednn" not in available_pack_layouts(torch.bfloat16), reason="this torch build packs no bf16 weights"
)


@needs_bf16_pack
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5,), (64,), (3, 7)])
def test_the_projection_is_the_fp32_one_within_bf16_rounding(bias, shape):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(*shape, 96, generator=g) * 30  # the target's features have dims 100x the median
    proj = Bf16Projection(weight, b)
    got, want = proj(x), F.linear(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert 0.0 < float((got - want).norm() / want.norm()) < 1e-2
    # The product of the bf16-rounded operands, itself rounded to bf16 (oneDNN's bf16 GEMM writes bf16); the bias
    # is added in fp32 after.
    product = Bf16Projection(weight)(x)
    assert torch.equal(product.bfloat16().float(), product)
    assert torch.allclose(product, F.linear(x.bfloat16().float(), weight.bfloat16().float()), rtol=2**-8, atol=1e-3)
    assert torch.equal(got, product + b if bias else product)
    assert proj.nbytes() == 2 * weight.numel() + (b.nbytes if bias else 0)


@needs_bf16_pack
def test_the_copy_is_taken_once_so_later_weight_changes_do_not_reach_it():
    weight = torch.ones(8, 32)
    proj = Bf16Projection(weight)
    weight.zero_()
    assert torch.equal(proj(torch.ones(4, 32)), torch.full((4, 8), 32.0))


def test_only_2d_cpu_weights_are_copied():
    with pytest.raises(ValueError, match="2-D CPU weight"):
        Bf16Projection(torch.ones(2, 3, 4))


@pytest.mark.parametrize(
    "flags, layouts, native",
    [({"avx512f", "avx512_bf16"}, ("onednn",), True), ({"amx_bf16"}, ("onednn",), True),
     ({"avx512f", "avx512bw"}, ("onednn",), False),  # oneDNN would emulate bf16 dot products: slower than fp32
     ({"avx512_bf16"}, (), False)],
)
def test_bf16_is_native_where_the_cpu_has_bf16_dot_products_and_onednn_packs_bf16(monkeypatch, flags, layouts, native):
    monkeypatch.setattr(cpu_bf16_projection, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_bf16_projection, "available_pack_layouts", lambda dtype: layouts)
    assert bf16_gemm_is_native() is native


def test_the_copy_serves_projections_from_the_floor_up(monkeypatch):
    floor = cpu_bf16_projection.BF16_PROJECTION_MIN_ROWS
    assert not Bf16Projection.serves(floor - 1) and Bf16Projection.serves(floor) and Bf16Projection.serves(256)
    monkeypatch.setattr(cpu_bf16_projection, "BF16_PROJECTION_MIN_ROWS", 1)  # read at call time (the benchmark's A/B)
    assert Bf16Projection.serves(1)
