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
