"""Rotary position embedding (neox / rotate-half layout): default, Llama-3 and YaRN frequency scaling."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` features of every q/k head by position-dependent angles."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float) -> None:
        super().__init__()
        if rotary_dim % 2 != 0 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        # Not checkpoint tensors: derived from the config, so non-persistent buffers. cos and the
        # sign-folded sin (see ``rotate_heads``) are precomputed for every position in one [P, 2, rotary_dim]
        # table, so a layer fetches both with one index_select; elementwise, so each row equals
        # computing that position on the fly.
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)
        cos, sin = self._angles(torch.arange(max_position_embeddings, device=self.inv_freq.device))
        half = rotary_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos_signed_sin_cache", torch.stack((cos, signed_sin), dim=1), persistent=False)
        # Inside ``shared_rows(positions)``: that tensor and its gathered (cos, signed_sin) rows per dtype,
        # so the layers of one forward gather (and split and cast) once instead of once each.
        self._shared: Optional[tuple[torch.Tensor, dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]]] = None

    def _compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).to(torch.float32) / self.rotary_dim
        return 1.0 / (self.base**exponents)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, rotary_dim] (fp32) for positions < max_position_embeddings."""
        table = self.cos_signed_sin_cache[positions]
        half = self.rotary_dim // 2
        signed_sin = table[:, 1]
        return table[:, 0], torch.cat((-signed_sin[:, :half], signed_sin[:, half:]), dim=-1)

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate every head of ``x`` ``[T, heads, head_size]`` (q and k heads may share one tensor): a new tensor.

        Rotate-half form: out = x * cos + swap_halves(x) * signed_sin with signed_sin = [-sin, sin], which
        equals ``x * cos + cat(-x2, x1) * sin`` bit for bit (negation is exact) in four tensor ops.
        """
        t, heads = x.shape[0], x.shape[1]
        cos, signed_sin = self._cos_signed_sin(positions, x.dtype)  # [T, 1, rotary_dim], broadcast over heads
        rd, half = self.rotary_dim, self.rotary_dim // 2
        rot = x if rd == self.head_size else x[..., :rd]
        # swap_halves copies (a tensor of ours, scaled in place below): one roll on a contiguous tensor
        # (decode at batch 1), else a flip of the [.., 2, half] view (roll would first copy to contiguous).
        # Traced, always the flip (asked first: contiguity and roll's decomposition both branch on sizes
        # the compiled decode step's unbacked batch cannot answer; Inductor fuses either form into its loops).
        if not torch.compiler.is_compiling() and rot.is_contiguous():
            swapped = rot.roll(half, -1)
        else:
            swapped = rot.reshape(t, heads, 2, half).flip(2).view(t, heads, rd)
        out = rot * cos
        out += swapped.mul_(signed_sin)
        if rd == self.head_size:
            return out
        return torch.cat((out, x[..., rd:]), dim=-1)

    @contextmanager
    def shared_rows(self, positions: torch.Tensor) -> Iterator[None]:
        """Within the block, ``rotate_heads(positions, ...)`` reuses one gather of the table for this tensor.

        A model wraps its layer loop in it: every layer passes the same ``positions``, which the forward
        does not modify. Matching is by tensor identity, so any other positions tensor (a draft's, or
        another thread's forward on a shared module) just gathers its own rows.
        """
        prev = self._shared
        self._shared = (positions, {})
        try:
            yield
        finally:
            self._shared = prev

    def _cos_signed_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) ``[T, 1, rotary_dim]`` in ``dtype``; inside ``shared_rows`` gathered once per dtype."""
        shared = self._shared  # read once: another thread may swap it
        if shared is not None and shared[0] is positions:
            rows = shared[1].get(dtype)
            if rows is None:
                rows = shared[1][dtype] = self._gather_rows(positions, dtype)
            return rows
        return self._gather_rows(positions, dtype)

    def _gather_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.cos_signed_sin_cache.index_select(0, positions)  # [T, 2, rotary_dim]
        if table.dtype != dtype:
            table = table.to(dtype)
        cos, signed_sin = table.split(1, dim=1)
        return cos, signed_sin

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H*D] and k [T, Hkv*D] (or [T, H, D]); returns tensors of the input shapes."""
        q = self.rotate_heads(positions, self._as_heads(query)).reshape(query.shape)
        if key is query:  # one tensor to rotate (e.g. a draft's context keys)
            return q, q
        k = self.rotate_heads(positions, self._as_heads(key)).reshape(key.shape)
        return q, k

    def _as_heads(self, x: torch.Tensor) -> torch.Tensor:
        # Head count from the feature width, not -1: an IDLE forward (DP attention) has zero rows.
        heads = x.shape[-1] // self.head_size if x.dim() == 2 else x.shape[1]
        return x.reshape(x.shape[0], heads, self.head_size)


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama-3.1 scaling: long wavelengths slowed by ``factor``, short kept, a smooth ramp between."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position_embeddings: int,
    ) -> None:
        self.factor = factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        super().__init__(head_size, rotary_dim, max_position_embeddings, base)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times (1 when not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN (arXiv 2309.00071): frequencies blended between interpolated and extrapolated by a linear ramp
    over the dimensions whose wavelengths lie between ``beta_fast`` and ``beta_slow`` rotations of the
    original context; cos and sin scaled by ``attention_factor`` (DeepSeek derives it from ``mscale`` and
    ``mscale_all_dim``)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        factor: float,
        original_max_position_embeddings: int,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        attention_factor: Optional[float] = None,
        mscale: Optional[float] = None,
        mscale_all_dim: Optional[float] = None,
        truncate: bool = True,
    ) -> None:
        self.factor = factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast, self.beta_slow, self.truncate = beta_fast, beta_slow, truncate
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_get_mscale(factor)
        self.attention_factor = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base)

    def _correction_dim(self, num_rotations: float) -> float:
        """The dimension whose wavelength fits ``num_rotations`` times into the original context."""
        ctx = self.original_max_position_embeddings
        return (self.rotary_dim * math.log(ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(self.base))

    def _compute_inv_freq(self) -> torch.Tensor:
        extrapolated = super()._compute_inv_freq()
        interpolated = extrapolated / self.factor
        low, high = self._correction_dim(self.beta_fast), self._correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.rotary_dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp would divide by zero
        ramp = ((torch.arange(self.rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep_extrapolated = 1 - ramp
        return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super()._angles(positions)
        return cos * self.attention_factor, sin * self.attention_factor


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[dict[str, Any]] = None,
) -> RotaryEmbedding:
    """The rotary embedding a config asks for, shared by every layer with the same geometry and device.

    Sharing keeps one cos/sin table per model instead of one per layer. An unsupported ``rope_type``
    is a clear error.
    """
    scaling_key = None if rope_scaling is None else json.dumps(rope_scaling, sort_keys=True, default=str)
    key = (head_size, rotary_dim, max_position, float(base), scaling_key, str(torch.get_default_device()))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = _build_rope(head_size, rotary_dim, max_position, base, rope_scaling)
        _ROPE_CACHE[key] = rope
    return rope


def _build_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[dict[str, Any]],
) -> RotaryEmbedding:
    if rope_scaling is None:
        return RotaryEmbedding(head_size, rotary_dim, max_position, base)
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return RotaryEmbedding(head_size, rotary_dim, max_position, base)
    if rope_type == "llama3":
        missing = [
            k
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if k not in rope_scaling
        ]
        if missing:
            raise ValueError(f"llama3 rope scaling in config.json is missing {missing}")
        return Llama3RotaryEmbedding(
            head_size,
            rotary_dim,
            max_position,
            base,
            float(rope_scaling["factor"]),
            float(rope_scaling["low_freq_factor"]),
            float(rope_scaling["high_freq_factor"]),
            int(rope_scaling["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        if "factor" not in rope_scaling or "original_max_position_embeddings" not in rope_scaling:
            raise ValueError("yarn rope scaling in config.json needs factor and original_max_position_embeddings")

        def opt(key: str) -> Optional[float]:
            return None if rope_scaling.get(key) is None else float(rope_scaling[key])

        return YaRNScalingRotaryEmbedding(
            head_size,
            rotary_dim,
            max_position,
            base,
            float(rope_scaling["factor"]),
            int(rope_scaling["original_max_position_embeddings"]),
            beta_fast=opt("beta_fast") or 32.0,
            beta_slow=opt("beta_slow") or 1.0,
            attention_factor=opt("attention_factor"),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            truncate=bool(rope_scaling.get("truncate", True)),
        )
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: default, llama3, yarn); "
        "use a checkpoint without that rope scaling"
    )
