"""Small helpers shared by the tensor-parallel layers: group resolution, exact division, shape checks."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from sglite.srt.distributed.parallel_state import GroupCoordinator, get_attn_tp_group


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not match the parameter (shard) it is loaded into."""


def resolve_tp_group(group: Optional[GroupCoordinator]) -> GroupCoordinator:
    """The given group, else the attention-TP group (= the TP group without DP attention).

    Under DP attention every attention-DP group holds a full model replica sharded over its attn_tp
    ranks, the width the KV plan prices pools at; so weights default to that group.
    """
    return group if group is not None else get_attn_tp_group()


def bind_tp_group(layer: nn.Module, group: Optional[GroupCoordinator]) -> None:
    """Set ``layer.tp_group`` (resolved as in resolve_tp_group), ``layer.tp_size`` and ``layer.tp_rank``."""
    layer.tp_group = resolve_tp_group(group)
    layer.tp_size = layer.tp_group.world_size
    layer.tp_rank = layer.tp_group.rank_in_group


def new_weight_matrix(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised ``[out, in]`` weight for ``F.linear``, laid out for the current default device.

    On CPU it is stored column-major (the transpose of a contiguous ``[in, out]`` tensor): ``F.linear``
    then multiplies ``x @ W^T`` with a row-major right operand, which MKL/oneDNN run 1.3-2x faster at
    decode batch sizes (the row-major layout makes them repack W on every call). Shape, values and
    loaders are unchanged; elsewhere (CUDA, meta) the usual row-major layout.
    """
    if column_major_weights():
        return torch.empty(in_features, out_features, dtype=dtype).t()
    return torch.empty(out_features, in_features, dtype=dtype)


def column_major_weights() -> bool:
    """Whether weight matrices built now are stored column-major (CPU default device; see new_weight_matrix)."""
    return torch.get_default_device().type == "cpu"


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact integer division; a remainder is a clear error naming the quantity."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def check_full_shape(loaded: torch.Tensor, expected: Sequence[int], where: str) -> None:
    """Raise WeightShapeError when a checkpoint tensor (before TP sharding) has the wrong shape."""
    if tuple(loaded.shape) != tuple(expected):
        raise WeightShapeError(
            f"{where}: checkpoint tensor has shape {tuple(loaded.shape)} but the model expects "
            f"{tuple(expected)}"
        )
