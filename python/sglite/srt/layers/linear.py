"""Tensor-parallel linear layers: replicated, column-, merged-column-, QKV- and row-parallel.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that takes the full
(unsharded) checkpoint tensor, checks its shape, and copies this rank's shard into place. Column
layers shard the output dim; row layers shard the input dim and all-reduce their partial sums.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from sglite.srt.configs.model_config import kv_heads_per_rank
from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.cpu_gemm import linear
from sglite.srt.layers.utils import bind_tp_group, check_full_shape, divide, new_weight_matrix, resolve_tp_group


def _new_param(shape: Sequence[int], dtype: Optional[torch.dtype]) -> nn.Parameter:
    dtype = dtype or torch.get_default_dtype()
    if len(shape) == 2:
        return nn.Parameter(new_weight_matrix(shape[0], shape[1], dtype), requires_grad=False)
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=False)


def _init_weight_and_bias(
    layer: nn.Module, weight_shape: Sequence[int], bias_rows: int, bias: bool, params_dtype: Optional[torch.dtype]
) -> None:
    """Give ``layer`` its weight (and bias, else a registered ``None``), each loaded by ``layer.weight_loader``."""
    layer.weight = _new_param(weight_shape, params_dtype)
    layer.weight.weight_loader = layer.weight_loader
    layer.packed_weight = None  # set by cpu_gemm.pack_weights_for_cpu after loading
    if bias:
        layer.bias = _new_param((bias_rows,), params_dtype)
        layer.bias.weight_loader = layer.weight_loader
    else:
        layer.register_parameter("bias", None)


class ReplicatedLinear(nn.Module):
    """A linear layer held whole on every rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, params_dtype: Optional[torch.dtype] = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        _init_weight_and_bias(self, (output_size, input_size), output_size, bias, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Copy the whole tensor after a shape check."""
        check_full_shape(loaded, param.shape, type(self).__name__)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b."""
        return linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(nn.Module):
    """Output features split over the TP group; ``gather_output`` all-gathers them back."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        tp_group: Optional[GroupCoordinator] = None,
        output_size_per_partition: Optional[int] = None,
    ) -> None:
        super().__init__()
        bind_tp_group(self, tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.output_size_per_partition = (
            output_size_per_partition
            if output_size_per_partition is not None
            else divide(output_size, self.tp_size, f"{type(self).__name__} output_size")
        )
        n = self.output_size_per_partition
        _init_weight_and_bias(self, (n, input_size), n, bias, params_dtype)

    def _full_shape(self, param: nn.Parameter, rows: int) -> tuple[int, ...]:
        return (rows, self.input_size) if param.dim() == 2 else (rows,)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Copy rows ``[rank*n, (rank+1)*n)`` of the full tensor."""
        check_full_shape(loaded, self._full_shape(param, self.output_size), type(self).__name__)
        n = self.output_size_per_partition
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output columns (all of them with gather_output)."""
        y = linear(x, self.weight, self.bias, self.packed_weight)
        if self.gather_output and self.tp_size > 1:
            y = self.tp_group.all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused in one matmul (e.g. gate and up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:
        group = resolve_tp_group(tp_group)
        self.output_sizes = list(output_sizes)
        for i, size in enumerate(self.output_sizes):
            divide(size, group.world_size, f"MergedColumnParallelLinear output_sizes[{i}]")
        super().__init__(input_size, sum(self.output_sizes), bias, gather_output, params_dtype, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        """Load projection ``shard_id`` into its slice of the fused weight."""
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (index of the fused projection)")
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} outside the {len(self.output_sizes)} fused projections")
        size = self.output_sizes[shard_id]
        where = f"MergedColumnParallelLinear shard {shard_id}"
        check_full_shape(loaded, self._full_shape(param, size), where)
        local = size // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, self.tp_rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads split over TP, KV heads split or replicated past their count."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        tp_group: Optional[GroupCoordinator] = None,
        v_head_size: Optional[int] = None,
    ) -> None:
        group = resolve_tp_group(tp_group)
        tp = group.world_size
        self.head_size = head_size
        self.v_head_size = v_head_size if v_head_size is not None else head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        # The memory plan prices the pool with the same rule (one head replicated when ranks outnumber heads).
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp)
        self.num_kv_head_replicas = max(1, tp // total_num_kv_heads)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.v_size = self.num_kv_heads * self.v_head_size
        per_partition = self.q_size + self.kv_size + self.v_size
        full_out = (total_num_heads + total_num_kv_heads) * head_size + total_num_kv_heads * self.v_head_size
        super().__init__(hidden_size, full_out, bias, False, params_dtype, group, per_partition)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[str] = None) -> None:
        """Load the full q, k or v projection (``shard_id`` in 'q'/'k'/'v') into this rank's slice."""
        if shard_id == "q":
            full_rows, local, offset, shard_rank = self.total_num_heads * self.head_size, self.q_size, 0, self.tp_rank
        elif shard_id == "k":
            full_rows, local, offset = self.total_num_kv_heads * self.head_size, self.kv_size, self.q_size
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        elif shard_id == "v":
            full_rows, local = self.total_num_kv_heads * self.v_head_size, self.v_size
            offset, shard_rank = self.q_size + self.kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_full_shape(loaded, self._full_shape(param, full_rows), f"QKVParallelLinear {shard_id}_proj")
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, shard_rank * local, local))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split this rank's fused output into q, k, v."""
        return qkv.split([self.q_size, self.kv_size, self.v_size], dim=-1)


class RowParallelLinear(nn.Module):
    """Input features split over the TP group; partial products are all-reduced, then the bias added."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:
        super().__init__()
        bind_tp_group(self, tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, "RowParallelLinear input_size")
        _init_weight_and_bias(self, (output_size, self.input_size_per_partition), output_size, bias, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Weight: columns of this rank; bias: whole (added once, after the reduction)."""
        if param.dim() == 1:
            check_full_shape(loaded, (self.output_size,), "RowParallelLinear bias")
            param.data.copy_(loaded)
            return
        check_full_shape(loaded, (self.output_size, self.input_size), "RowParallelLinear")
        n = self.input_size_per_partition
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial x W^T summed over ranks, plus the bias."""
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        if not self.input_is_parallel:
            n = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * n, n)
        y = linear(x, self.weight, None, self.packed_weight)
        if self.reduce_results:
            y = self.tp_group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


LinearLayer = Union[ReplicatedLinear, ColumnParallelLinear, RowParallelLinear]
