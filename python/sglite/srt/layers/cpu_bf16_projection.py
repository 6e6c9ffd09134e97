"""bf16 copies of fp32 CPU weights for wide projections, where the CPU multiplies bf16 natively.

A DFLASH/DSPARK draft keeps its context K/V written while drafting is off (the draft-free steps' features,
deferred and written a few hundred rows at a time, and every prompt's), so the projection of those rows (``fc``,
then each draft layer's K/V rows) is work a plain server does not do: ~1.3% of the target's FLOPs per token on the
default pair. Those writes are wide, compute-bound GEMMs, and a CPU with bf16 dot products (AVX512_BF16, AMX)
runs them at ~2x the fp32 rate through oneDNN's bf16 pack: measured 43.8 -> 23.0 us a row for the whole
256-row write on an AVX-512 EPYC (docs/benchmarks.md, "bf16 context writes of the CPU draft").
Inputs and weights are rounded to bf16, products accumulate in fp32 and the GEMM writes bf16 (oneDNN's bf16
kernels have no fp32 output here): the draft's K/V move by ~3e-3 (relative), which changes drafts at most, never
what the target accepts (the held-out accept length did not move: 1.783 -> 1.786 greedy).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglite.srt.layers.cpu_gemm import available_pack_layouts, pack_weight
from sglite.srt.layers.cpu_kernel_build import cpu_flags

# The fewest rows worth the bf16 copy: the default draft's whole context write of 1 / 2 / 3 / 4 / 16 / 256 rows takes
# 1.15 / 1.13 / 0.90 / 0.89 / 0.33 / 0.52x the fp32 route's time (``benchmark/profile_cpu_decode.py context-write``;
# a row or two is bound by reading the weights, where the fp32 route reads fc's Q8_0 blocks, half the bf16 bytes).
BF16_PROJECTION_MIN_ROWS = 4

# The CPU flags of native bf16 dot products (elsewhere oneDNN emulates them, slower than fp32).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_gemm_is_native() -> bool:
    """Whether bf16 GEMMs run at the native bf16 rate here: oneDNN packs bf16 and the CPU has bf16 dot products."""
    return "onednn" in available_pack_layouts(torch.bfloat16) and bool(cpu_flags() & NATIVE_BF16_FLAGS)


class Bf16Projection:
    """``x W^T + b`` for ``[rows, in]`` fp32 inputs through a oneDNN-packed bf16 copy of ``W``, returned as fp32.

    Invariant: the copy is taken once, from the weight as it will stay (after any rounding at load); the fp32
    weight keeps serving every other call.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a bf16 projection copies a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight.detach().to(torch.bfloat16), "onednn")
        self.bias = None if bias is None else bias.detach().float().clone()

    @staticmethod
    def serves(rows: int) -> bool:
        """Whether a projection of this many rows takes the bf16 copy (``BF16_PROJECTION_MIN_ROWS``)."""
        return rows >= BF16_PROJECTION_MIN_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The projection of ``x`` (any leading shape), in fp32."""
        out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "").float()
        return out if self.bias is None else out + self.bias

    def nbytes(self) -> int:
        """Bytes of the bf16 copy (and the fp32 bias)."""
        return 2 * self.out_features * self.in_features + (0 if self.bias is None else self.bias.nbytes)
