"""KV pools: request→token table, MHA/GQA, MLA, hybrid sliding-window pair, hybrid linear; DFLASH deferred rows.

Every pool allocates one tensor per layer (so a layer's buffer is a plain view for the kernels) and
reports ``nbytes()``, the exact bytes of its tensors. Each pool also has a static ``planned_bytes(...)``
computed from the same constructor arguments, which the memory plan uses; the unit tests pin
``planned_bytes == nbytes()`` on real and ``meta`` devices. Slot ``i`` of a token pool is the same
token in every pool (target and draft share one allocator); buffers have ``size + page_size`` rows
because the first page is the allocator's padding page.
"""

from __future__ import annotations

import abc
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


def _pool_layer_ids(layer_num: int, layer_ids: Optional[Sequence[int]]) -> list[int]:
    """The model-layer ids a pool holds: ``0..layer_num-1`` by default, else ``layer_ids`` of that length."""
    ids = list(range(layer_num)) if layer_ids is None else list(layer_ids)
    if len(ids) != layer_num:
        raise ValueError(f"layer_ids has {len(ids)} entries for layer_num {layer_num}")
    return ids


class BaseTokenToKVPool(abc.ABC):
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
        if x.dtype != self.dtype:  # a check, not a no-op .to() per layer (each op costs a dispatch on CPU)
            x = x.to(self.dtype)
        return x.view(self.store_dtype) if self.store_dtype != self.dtype else x

    def _load(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    @abc.abstractmethod
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the pool owns."""

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
        ids = _pool_layer_ids(layer_num, layer_ids)
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
        k = self._store(cache_k.reshape(n, self.head_num, self.head_dim))
        v = self._store(cache_v.reshape(n, self.head_num, self.v_head_dim))
        if loc.dtype == torch.int64:  # index_copy_ skips advanced indexing's setup (cheaper per layer on CPU)
            flat = loc if loc.dim() == 1 else loc.reshape(-1)
            self.k_buffer[i].index_copy_(0, flat, k)
            self.v_buffer[i].index_copy_(0, flat, v)
        else:
            self.k_buffer[i][loc] = k
            self.v_buffer[i][loc] = v


class MLATokenToKVPool(BaseTokenToKVPool):
    """Per-layer latent buffer ``[size+page, 1, kv_lora_rank + qk_rope_head_dim]`` (not sharded by TP)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: Device,
        *,
        layer_ids: Optional[Sequence[int]] = None,
    ) -> None:
        ids = _pool_layer_ids(layer_num, layer_ids)
        super().__init__(size, page_size, dtype, ids, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [_alloc((self.num_slots, 1, self.kv_cache_dim), self.store_dtype, device) for _ in ids]

    @staticmethod
    def cell_bytes(dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int) -> int:
        """Bytes one token slot costs across all layers of this pool."""
        return (kv_lora_rank + qk_rope_head_dim) * layer_num * kv_dtype_bytes(dtype)

    @staticmethod
    def planned_bytes(
        size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int
    ) -> int:
        """Bytes the pool will allocate (padding page included)."""
        return (size + page_size) * MLATokenToKVPool.cell_bytes(dtype, kv_lora_rank, qk_rope_head_dim, layer_num)

    def buffers(self) -> list[torch.Tensor]:
        """Latent buffer of every layer."""
        return list(self.kv_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The whole latent (compressed KV ++ rope key) of a layer."""
        return self._load(self.kv_buffer[self._index(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The compressed-KV part of the latent (the values MLA attends over)."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent, compressed part) of a layer."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor] = None
    ) -> None:
        """Write latents ``[n, 1, kv_lora_rank + rope]`` at ``loc`` (``cache_v`` is unused: V lives in K)."""
        n = loc.numel()
        self.kv_buffer[self._index(layer_id)][loc] = self._store(cache_k.reshape(n, 1, self.kv_cache_dim))

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write the compressed KV and the rope key separately."""
        n = loc.numel()
        latent = torch.cat([k_nope.reshape(n, 1, self.kv_lora_rank), k_rope.reshape(n, 1, self.qk_rope_head_dim)], -1)
        self.set_kv_buffer(layer_id, loc, latent)


# ====================================================================== hybrid sliding window


class SWAKVPool:
    """Full-attention layers in a pool of ``full_size`` slots, sliding layers in a smaller ``swa_size`` pool.

    Token slots are full-pool indices everywhere (req_to_token, allocator output); a sliding layer's
    slot is ``full_to_swa_index_mapping[full_slot]`` (0 = the token's sliding slot was freed or never
    allocated). The pool owns the mapping (it is device memory priced per full token);
    ``SWATokenToKVPoolAllocator`` fills it.
    """

    MAPPING_DTYPE = torch.int64

    def __init__(
        self,
        full_size: int,
        swa_size: int,
        page_size: int,
        dtype: torch.dtype,
        full_head_num: int,
        full_head_dim: int,
        full_v_head_dim: int,
        full_layer_ids: Sequence[int],
        swa_head_num: int,
        swa_head_dim: int,
        swa_v_head_dim: int,
        swa_layer_ids: Sequence[int],
        device: Device,
    ) -> None:
        if set(full_layer_ids) & set(swa_layer_ids):
            raise ValueError("a layer cannot be both full and sliding")
        self.size = full_size
        self.swa_size = swa_size
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.full_pool = MHATokenToKVPool(
            full_size, page_size, dtype, full_head_num, full_head_dim, full_v_head_dim,
            len(full_layer_ids), device, layer_ids=full_layer_ids,
        )
        self.swa_pool = MHATokenToKVPool(
            swa_size, page_size, dtype, swa_head_num, swa_head_dim, swa_v_head_dim,
            len(swa_layer_ids), device, layer_ids=swa_layer_ids,
        )
        self._is_swa = {int(i): True for i in swa_layer_ids}
        self._is_swa.update({int(i): False for i in full_layer_ids})
        self.full_to_swa_index_mapping = _alloc((full_size + page_size,), self.MAPPING_DTYPE, device)

    @staticmethod
    def planned_bytes(
        full_size: int,
        swa_size: int,
        page_size: int,
        dtype: torch.dtype,
        full_head_num: int,
        full_head_dim: int,
        full_v_head_dim: int,
        num_full_layers: int,
        swa_head_num: int,
        swa_head_dim: int,
        swa_v_head_dim: int,
        num_swa_layers: int,
    ) -> dict[str, int]:
        """Bytes per part: ``full``, ``swa`` and ``mapping``."""
        return {
            "full": MHATokenToKVPool.planned_bytes(
                full_size, page_size, dtype, full_head_num, full_head_dim, full_v_head_dim, num_full_layers
            ),
            "swa": MHATokenToKVPool.planned_bytes(
                swa_size, page_size, dtype, swa_head_num, swa_head_dim, swa_v_head_dim, num_swa_layers
            ),
            "mapping": (full_size + page_size) * kv_dtype_bytes(SWAKVPool.MAPPING_DTYPE),
        }

    def part_nbytes(self) -> dict[str, int]:
        """Exact bytes per part: ``full``, ``swa`` and ``mapping``."""
        return {
            "full": self.full_pool.nbytes(),
            "swa": self.swa_pool.nbytes(),
            "mapping": _tensor_bytes(self.full_to_swa_index_mapping),
        }

    def nbytes(self) -> int:
        """Exact bytes of all tensors (both pools and the mapping)."""
        return sum(self.part_nbytes().values())

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether a model layer lives in the sliding pool."""
        try:
            return self._is_swa[layer_id]
        except KeyError:
            raise KeyError(f"SWAKVPool has no layer {layer_id}") from None

    def translate_loc_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """Sliding-pool slots of full-pool slots."""
        return self.full_to_swa_index_mapping[loc.long()]

    def _pool(self, layer_id: int) -> MHATokenToKVPool:
        return self.swa_pool if self.is_swa_layer(layer_id) else self.full_pool

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of a layer (sliding layers: indexed by sliding slots)."""
        return self._pool(layer_id).get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of a layer (sliding layers: indexed by sliding slots)."""
        return self._pool(layer_id).get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) buffers of a layer."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K/V at full-pool slots ``loc``; sliding layers translate them through the mapping."""
        if self.is_swa_layer(layer_id):
            self.swa_pool.set_kv_buffer(layer_id, self.translate_loc_to_swa(loc), cache_k, cache_v)
        else:
            self.full_pool.set_kv_buffer(layer_id, loc, cache_k, cache_v)


# ====================================================================== hybrid linear (recurrent state)


class MambaStatePool:
    """Per-request recurrent state of linear-attention layers: ``size`` slots plus dummy slot 0.

    Per layer: a temporal state ``[size+1, heads, k_dim, v_dim]`` (``ssm_dtype``) and a short-conv
    window ``[size+1, conv_channels, conv_kernel-1]`` (``conv_dtype``); counts are per rank.
    """

    def __init__(
        self,
        size: int,
        layer_ids: Sequence[int],
        num_heads: int,
        state_k_dim: int,
        state_v_dim: int,
        conv_channels: int,
        conv_kernel: int,
        ssm_dtype: torch.dtype,
        conv_dtype: torch.dtype,
        device: Device,
    ) -> None:
        if size < 1:
            raise ValueError(f"MambaStatePool needs size >= 1, got {size}")
        self.size = size
        self.layer_ids = [int(i) for i in layer_ids]
        self._layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.device = torch.device(device)
        rows = size + 1
        self.ssm_state = [
            _alloc((rows, num_heads, state_k_dim, state_v_dim), ssm_dtype, device) for _ in self.layer_ids
        ]
        self.conv_state = [
            _alloc((rows, conv_channels, conv_kernel - 1), conv_dtype, device) for _ in self.layer_ids
        ]
        self._free = list(range(1, size + 1))

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_heads: int, state_k_dim: int, state_v_dim: int, conv_channels: int, conv_kernel: int,
        ssm_dtype: torch.dtype, conv_dtype: torch.dtype,
    ) -> int:
        """Bytes of one request's state across all linear layers."""
        ssm = num_heads * state_k_dim * state_v_dim * kv_dtype_bytes(ssm_dtype)
        conv = conv_channels * (conv_kernel - 1) * kv_dtype_bytes(conv_dtype)
        return num_layers * (ssm + conv)

    @staticmethod
    def planned_bytes(size: int, num_layers: int, *geometry) -> int:
        """Bytes the pool will allocate (dummy slot included); ``geometry`` as in ``bytes_per_slot``."""
        return (size + 1) * MambaStatePool.bytes_per_slot(num_layers, *geometry)

    def nbytes(self) -> int:
        """Exact bytes of all state tensors."""
        return sum(_tensor_bytes(t) for t in self.ssm_state + self.conv_state)

    def available_size(self) -> int:
        """Free state slots."""
        return len(self._free)

    def alloc(self, need_size: int = 1) -> Optional[list[int]]:
        """Free state slots, or None when short."""
        if need_size > len(self._free):
            return None
        out, self._free = self._free[:need_size], self._free[need_size:]
        return out

    def free(self, slots: Union[int, Sequence[int]]) -> None:
        """Return state slots (their contents are zeroed on the next use by the model)."""
        self._free.extend([slots] if isinstance(slots, int) else [int(s) for s in slots])

    def get_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(temporal state, conv window) tensors of a linear layer."""
        i = self._layer_index[layer_id]
        return self.ssm_state[i], self.conv_state[i]


class HybridLinearKVPool:
    """Attention layers' KV (an MHA or MLA pool over those layer ids) plus a recurrent ``MambaStatePool``."""

    def __init__(self, kv_pool: BaseTokenToKVPool, state_pool: MambaStatePool) -> None:
        overlap = set(kv_pool.layer_ids) & set(state_pool.layer_ids)
        if overlap:
            raise ValueError(f"layers {sorted(overlap)} are both attention and linear")
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.size = kv_pool.size
        self.page_size = kv_pool.page_size
        self.dtype = kv_pool.dtype
        self.device = kv_pool.device

    def part_nbytes(self) -> dict[str, int]:
        """Exact bytes per part: ``kv`` and ``state``."""
        return {"kv": self.kv_pool.nbytes(), "state": self.state_pool.nbytes()}

    def nbytes(self) -> int:
        """Exact bytes of the KV and state tensors."""
        return sum(self.part_nbytes().values())

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of an attention layer."""
        return self.kv_pool.get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of an attention layer."""
        return self.kv_pool.get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) buffers of an attention layer."""
        return self.kv_pool.get_kv_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K/V of an attention layer."""
        self.kv_pool.set_kv_buffer(layer_id, loc, cache_k, cache_v)


# ====================================================================== DFLASH deferred context rows


class DeferredContextRows:
    """Draft-free DFLASH steps' feature rows, positions and slots, waiting for one batched draft context K/V write.

    One buffer of ``rows`` rows, allocated with the pools and priced by the plan like them: features
    ``[rows, feature_width]`` in the runtime dtype (the target's captured layers, concatenated), positions
    and slots ``int64``. ``append`` copies into it (a replayed CUDA graph reuses its output buffers, so the
    rows must be copied out anyway) and never grows it; ``pending`` are views of the rows written so far.
    """

    INDEX_DTYPE = torch.int64

    def __init__(self, rows: int, feature_width: int, dtype: torch.dtype, device: Device) -> None:
        if rows < 1 or feature_width < 1:
            raise ValueError(f"DeferredContextRows needs rows >= 1 and feature_width >= 1 (got {rows}, {feature_width})")
        self.capacity = rows
        self.feature_width = feature_width
        self.dtype = dtype
        self.features = _alloc((rows, feature_width), dtype, device)
        self.positions = _alloc((rows,), self.INDEX_DTYPE, device)
        self.slots = _alloc((rows,), self.INDEX_DTYPE, device)
        self.size = 0  # rows written since the last clear

    @staticmethod
    def planned_bytes(rows: int, feature_width: int, dtype: torch.dtype) -> int:
        """Bytes the buffer will take."""
        index_bytes = 2 * kv_dtype_bytes(DeferredContextRows.INDEX_DTYPE)
        return rows * (feature_width * kv_dtype_bytes(dtype) + index_bytes)

    def nbytes(self) -> int:
        """Exact bytes of the three tensors."""
        return sum(_tensor_bytes(t) for t in (self.features, self.positions, self.slots))

    @property
    def free_rows(self) -> int:
        """Rows still free before a flush is due."""
        return self.capacity - self.size

    def append(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy one step's rows in after those already waiting; more than ``free_rows`` is an error (flush first)."""
        n = int(slots.numel())
        if features.shape != (n, self.feature_width) or positions.numel() != n:
            raise ValueError(
                f"deferred context rows: features {tuple(features.shape)}, {positions.numel()} positions and {n} "
                f"slots; expected [{n}, {self.feature_width}] features and one position per slot"
            )
        if features.dtype != self.dtype:  # copy_ would convert silently: the plan priced this dtype
            raise ValueError(f"deferred context features are {features.dtype}, the planned buffer holds {self.dtype}")
        if n > self.free_rows:
            raise ValueError(f"{n} deferred context rows do not fit the {self.free_rows} free rows; flush first")
        end = self.size + n
        self.features[self.size : end].copy_(features)
        self.positions[self.size : end].copy_(positions)
        self.slots[self.size : end].copy_(slots)
        self.size = end

    def pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, positions, slots) of the rows waiting, as views of the buffer."""
        return self.features[: self.size], self.positions[: self.size], self.slots[: self.size]

    def clear(self) -> None:
        """Forget the waiting rows (after their K/V was written)."""
        self.size = 0
