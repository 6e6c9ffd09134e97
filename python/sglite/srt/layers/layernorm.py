"""RMSNorm with an optional fused residual add (the residual stream is kept un-normalised)."""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import nn

from sglite.srt.layers.utils import check_full_shape


@functools.lru_cache(maxsize=None)
def _cpu_fp32(value: float) -> torch.Tensor:
    """A 0-dim fp32 CPU tensor holding ``value`` (made once; a normal tensor even under inference mode)."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=torch.float32)


def rms_normalize(x: torch.Tensor, eps: float, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``: fp32 math, cast back to x's dtype before the weight.

    fp32 tensors: the formula with in-place scalar steps, bit-identical to ``F.rms_norm`` (its CPU
    composite runs the same kernels in the same order) with three allocations and two wrapper levels
    less per call; on a CPU decode step each small op runs with caches cold from the GEMMs, where that
    overhead shows (docs/benchmarks.md, "SmolLM2 decode profile"). Other dtypes: the explicit
    formula with upcast, whose rounding order transformers uses.
    """
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        if x.device.type == "cpu" and not torch.compiler.is_compiling():  # compiled, Inductor fuses it all
            # CPU ``mean`` is ``sum`` then ``div_`` by the count, and each Python-scalar operand is first
            # copied into a tensor (an extra op with an allocation); fp32 0-dim tensors give the same
            # values (the same kernels run) without those two copies per call.
            var = torch.mul(x, x).sum(-1, keepdim=True).div_(_cpu_fp32(float(x.shape[-1])))
            scale = var.add_(_cpu_fp32(eps)).rsqrt_()
        else:
            scale = torch.mul(x, x).mean(-1, keepdim=True).add_(eps).rsqrt_()
        out = torch.mul(x, scale)
        return out if weight is None else out.mul_(weight)
    h = x.to(torch.float32)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Copy the (replicated) scale."""
        check_full_shape(loaded, (self.hidden_size,), "RMSNorm")
        param.data.copy_(loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.variance_epsilon, self.weight)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
