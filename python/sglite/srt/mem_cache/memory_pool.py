"""KV pools: request→token table, MHA/GQA, MLA, hybrid sliding-window pair, hybrid linear.

Every pool allocates one tensor per layer (so a layer's buffer is a plain view for the kernels) and
reports ``nbytes()``, the exact bytes of its tensors. Each pool also has a static ``planned_bytes(...)``
computed from the same constructor arguments, which the memory plan uses; the unit tests pin
``planned_bytes == nbytes()`` on real and ``meta`` devices. Slot ``i`` of a token pool is the same
token in every pool (target and draft share one allocator); buffers have ``size + page_size`` rows
because the first page is the allocator's padding page.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from sglite.srt.mem_cache.kv_cache_dtype import kv_dtype_bytes, storage_dtype

Device = Union[str, torch.device]


def _alloc(shape: Sequence[int], dtype: torch.dtype, device: Device) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device=dev)
    return torch.zeros(tuple(shape), dtype=dtype, device=dev)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ====================================================================== req -> token


class ReqToTokenPool:
    """``req_to_token[row, i]`` = KV slot of token ``i`` of the request in ``row``; row 0 is a dummy."""

    def __init__(self, size: int, max_context_len: int, device: Device, dtype: torch.dtype = torch.int32) -> None:
        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context_len >= 1 (got {size}, {max_context_len})")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = _alloc((size + 1, max_context_len), dtype, device)
        self.clear()

    @staticmethod
    def planned_bytes(size: int, max_context_len: int, dtype: torch.dtype = torch.int32) -> int:
        """Bytes the table will take."""
        return (size + 1) * max_context_len * kv_dtype_bytes(dtype)

    def clear(self) -> None:
        """Mark every row (1..size) free."""
        self._free_rows: list[int] = list(range(1, self.size + 1))
        self._row_is_free = [False] + [True] * self.size

    def available_size(self) -> int:
        """Free request rows."""
        return len(self._free_rows)

    def alloc(self, need_size: int = 1) -> Optional[list[int]]:
        """``need_size`` free rows, or None when short."""
        if need_size > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:need_size], self._free_rows[need_size:]
        for r in rows:
            self._row_is_free[r] = False
        return rows

    def free(self, rows: Union[int, Sequence[int]]) -> None:
        """Return rows to the free list; freeing a free row or row 0 is an error."""
        for r in [rows] if isinstance(rows, int) else list(rows):
            r = int(r)
            if r < 1 or r > self.size or self._row_is_free[r]:
                raise ValueError(f"ReqToTokenPool.free: row {r} is not an allocated row")
            self._row_is_free[r] = True
            self._free_rows.append(r)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Write slots for tokens ``[start, start+len(slots))`` of one request."""
        self.req_to_token[row, start : start + slots.numel()] = slots.to(self.req_to_token.dtype)

    def nbytes(self) -> int:
        """Exact bytes of the table."""
        return _tensor_bytes(self.req_to_token)


# ====================================================================== token -> KV


class BaseTokenToKVPool:
    """Shared bookkeeping: size, page, dtype (FP8 stored as uint8) and the model-layer → buffer map."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_ids: Sequence[int],
        device: Device,
    ) -> None:
        if size < 0 or page_size < 1:
            raise ValueError(f"pool size {size} / page_size {page_size} invalid")
        if size % page_size != 0:
            raise ValueError(f"pool size {size} is not a multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = storage_dtype(dtype)
        self.device = torch.device(device)
        self.layer_ids = [int(i) for i in layer_ids]
        self.layer_num = len(self.layer_ids)
        # layer_id is the model's own index; hybrid models keep only some layers in a given pool.
        self._layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        if len(self._layer_index) != self.layer_num:
            raise ValueError(f"duplicate layer ids {self.layer_ids}")

    @property
    def num_slots(self) -> int:
        """Rows per buffer: usable slots plus the padding page."""
        return self.size + self.page_size

    def _index(self, layer_id: int) -> int:
        try:
            return self._layer_index[layer_id]
        except KeyError:
            raise KeyError(
                f"{type(self).__name__} holds layers {self.layer_ids}, not layer {layer_id}"
            ) from None

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        return x.view(self.store_dtype) if self.store_dtype != self.dtype else x

    def _load(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the pool owns."""
        raise NotImplementedError  # abstract: each pool lists its own tensors

    def nbytes(self) -> int:
        """Exact bytes of all tensors of this pool."""
        return sum(_tensor_bytes(t) for t in self.buffers())


class MHATokenToKVPool(BaseTokenToKVPool):
    """Per-layer K ``[size+page, head_num, head_dim]`` and V ``[size+page, head_num, v_head_dim]``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        v_head_dim: int,
        layer_num: int,
        device: Device,
        *,
        layer_ids: Optional[Sequence[int]] = None,
    ) -> None:
        ids = list(range(layer_num)) if layer_ids is None else list(layer_ids)
        if len(ids) != layer_num:
            raise ValueError(f"layer_ids has {len(ids)} entries for layer_num {layer_num}")
        super().__init__(size, page_size, dtype, ids, device)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        rows = self.num_slots
        self.k_buffer = [_alloc((rows, head_num, head_dim), self.store_dtype, device) for _ in ids]
        self.v_buffer = [_alloc((rows, head_num, v_head_dim), self.store_dtype, device) for _ in ids]

    @staticmethod
    def cell_bytes(dtype: torch.dtype, head_num: int, head_dim: int, v_head_dim: int, layer_num: int) -> int:
        """Bytes one token slot costs across all layers of this pool."""
        return head_num * (head_dim + v_head_dim) * layer_num * kv_dtype_bytes(dtype)

    @staticmethod
    def planned_bytes(
        size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, v_head_dim: int, layer_num: int
    ) -> int:
        """Bytes the pool will allocate (padding page included)."""
        return (size + page_size) * MHATokenToKVPool.cell_bytes(dtype, head_num, head_dim, v_head_dim, layer_num)

    def buffers(self) -> list[torch.Tensor]:
        """K then V buffers of every layer."""
        return self.k_buffer + self.v_buffer

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of a model layer, in the KV dtype."""
        return self._load(self.k_buffer[self._index(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of a model layer, in the KV dtype."""
        return self._load(self.v_buffer[self._index(layer_id)])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) buffers of a model layer."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K/V rows (``[n, head_num, head_dim]`` or ``[n, head_num*head_dim]``) at slots ``loc``."""
        i = self._index(layer_id)
        n = loc.numel()
        self.k_buffer[i][loc] = self._store(cache_k.reshape(n, self.head_num, self.head_dim))
        self.v_buffer[i][loc] = self._store(cache_v.reshape(n, self.head_num, self.v_head_dim))
