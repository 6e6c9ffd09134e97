"""Triton attention backend over the paged pool, with the kernels in ``triton_ops``.

DECODE and batches whose requests add at most ``split_block_max`` tokens (TARGET_VERIFY / DRAFT_BLOCK
blocks, short extends) use the split-K kernel; longer extends use the flash-attention extend kernel.
EXTEND / DECODE / TARGET_VERIFY are causal, DRAFT_BLOCK is not. On CPU it runs only under
``TRITON_INTERPRET=1`` (tests)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import triton

from sglite.srt.layers.attention.base_attn_backend import AttentionBackend, cpu_list, mode_name
from sglite.srt.layers.attention.triton_ops.common import INTERPRET
from sglite.srt.layers.attention.triton_ops.decode_attention import (
    MAX_SPLIT_BLOCK,
    block_split_attention_fwd,
    decode_attention_fwd,
    split_tile,
)
from sglite.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

if TYPE_CHECKING:
    from sglite.srt.layers.attention.radix_attention import RadixAttention
    from sglite.srt.model_executor.forward_batch_info import ForwardBatch

MAX_KV_SPLITS = 16


@dataclass
class TritonForwardMetadata:
    """Per-batch index tensors shared by every layer of one forward."""

    mode: str
    q_start: Optional[torch.Tensor] = None  # [bs] first new token of each request (extend family)
    max_extend_len: int = 0


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(batch_size: int, num_kv_heads: int, group: int, device: torch.device, block_q: int = 1) -> int:
    """Decode split count: enough programs to fill the GPU, a power of two (few kernel variants), ≤ 16.

    It depends only on the batch size and head geometry, never on sequence lengths, so a captured
    CUDA graph stays valid. The interpreter uses 2 (exercises the merge, keeps grids small).
    """
    if INTERPRET or device.type != "cuda":
        return 2
    programs_per_split = batch_size * num_kv_heads * split_tile(group, block_q)[1]
    want = triton.cdiv(2 * _num_sms(device), max(1, programs_per_split))
    return min(MAX_KV_SPLITS, triton.next_power_of_2(want))


def _write_q_start(q_start: torch.Tensor, extend_lens: torch.Tensor) -> None:
    """Exclusive cumsum of new-token counts into ``q_start`` in place (device ops only, no host sync)."""
    q_start[:1].zero_()
    if q_start.numel() > 1:
        q_start[1:].copy_(torch.cumsum(extend_lens[:-1], dim=0))


class TritonAttnBackend(AttentionBackend):
    """Attention over the paged KV pool with the kernels in ``triton_ops``.

    CUDA graphs (``supports_cuda_graph``): graph metadata lives in its own persistent buffer
    (``q_start`` offsets, refreshed in place by ``init_forward_metadata_replay_cuda_graph`` with a device
    cumsum), and the split-K scratch is one grow-only buffer whose outgrown predecessors are kept alive,
    so a captured graph never points at freed memory. The kernels' grids depend only on the batch size,
    the block size and the split count (a function of the batch size and head geometry), never on
    sequence lengths: each program derives its KV chunk from ``seq_lens`` on the device, so one graph
    serves every context length. A captured extend-family graph bakes in its block size (grid).
    """

    supports_cuda_graph = True

    def __init__(
        self, runner: Any = None, num_kv_splits: Optional[int] = None, split_block_max: int = MAX_SPLIT_BLOCK
    ) -> None:
        if not 0 <= split_block_max <= MAX_SPLIT_BLOCK:
            raise ValueError(f"split_block_max must be in [0, {MAX_SPLIT_BLOCK}] (0 = extend kernel for every block)")
        self.runner = runner
        self.fixed_num_kv_splits = num_kv_splits
        self.split_block_max = split_block_max
        self.metadata: Optional[TritonForwardMetadata] = None
        self._scratch_buf: Optional[torch.Tensor] = None
        self._retired_scratch: list[torch.Tensor] = []
        self._q_start_buf: Optional[torch.Tensor] = None
        # CUDA graphs: q_start of graph batches (apart from the eager buffer, which eager forwards rewrite)
        # and the metadata captured per (mode, batch size, block size).
        self._cg_q_start: Optional[torch.Tensor] = None
        self._cg_metadata: dict[tuple[str, int, int], TritonForwardMetadata] = {}

    def reserve(self, max_batch_size: int, device: Optional[torch.device] = None) -> None:
        """Allocate the persistent metadata buffers for up to ``max_batch_size`` requests."""
        dev = torch.device(device if device is not None else getattr(self.runner, "device", "cpu"))
        if self._q_start_buf is None or self._q_start_buf.numel() < max_batch_size or self._q_start_buf.device != dev:
            self._q_start_buf = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Exclusive cumsum of new-token counts (q offsets) and the longest extend, once per batch."""
        name = mode_name(forward_batch)
        if name in ("IDLE", "DECODE"):
            self.metadata = TritonForwardMetadata(mode=name)
            return
        extend_lens = forward_batch.extend_seq_lens
        bs = extend_lens.numel()
        self.reserve(bs, extend_lens.device)
        q_start = self._q_start_buf[:bs]  # type: ignore[index]
        _write_q_start(q_start, extend_lens)
        max_extend = max(cpu_list(forward_batch.extend_seq_lens_cpu, extend_lens), default=0)
        self.metadata = TritonForwardMetadata(mode=name, q_start=q_start, max_extend_len=max_extend)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the graph q_start buffer for up to ``max_bs`` requests (kept if already large enough)."""
        dev = torch.device(getattr(self.runner, "device", "cpu"))
        if self._cg_q_start is None or self._cg_q_start.numel() < max_bs or self._cg_q_start.device != dev:
            if self._cg_metadata:
                raise RuntimeError("TritonAttnBackend: init_cuda_graph_state would move a buffer captured graphs read")
            self._cg_q_start = torch.zeros(max_bs, dtype=torch.int64, device=dev)

    @staticmethod
    def _graph_key(forward_batch: "ForwardBatch") -> tuple[str, int, int]:
        # The static batch's host lists carry its shape (block size), not live values.
        name = mode_name(forward_batch)
        block = 1 if name == "DECODE" else max(int(n) for n in forward_batch.extend_seq_lens_cpu)
        return name, forward_batch.batch_size, block

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """Metadata over the graph buffers for capturing a static batch (DECODE, TARGET_VERIFY, DRAFT_BLOCK)."""
        name, bs, block = key = self._graph_key(forward_batch)
        if name == "DECODE":
            meta = TritonForwardMetadata(mode=name)
        elif name in ("TARGET_VERIFY", "DRAFT_BLOCK"):
            if self._cg_q_start is None or self._cg_q_start.numel() < bs:
                raise RuntimeError("TritonAttnBackend: call init_cuda_graph_state(max_bs, ...) before capturing")
            meta = TritonForwardMetadata(mode=name, q_start=self._cg_q_start[:bs], max_extend_len=block)
            _write_q_start(meta.q_start, forward_batch.extend_seq_lens)
        else:
            raise ValueError(f"TritonAttnBackend captures DECODE / TARGET_VERIFY / DRAFT_BLOCK graphs, not {name}")
        self._cg_metadata[key] = meta
        self.metadata = meta

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """Refresh q_start in place from the static batch's device tensors and select the captured metadata."""
        key = self._graph_key(forward_batch)
        meta = self._cg_metadata.get(key)
        if meta is None:
            raise RuntimeError(f"TritonAttnBackend: no graph captured for (mode, batch size, block) {key}")
        if meta.q_start is not None:
            _write_q_start(meta.q_start, forward_batch.extend_seq_lens)
        self.metadata = meta

    def _metadata_for(self, forward_batch: "ForwardBatch") -> TritonForwardMetadata:
        if self.metadata is None or self.metadata.mode != mode_name(forward_batch):
            raise RuntimeError("TritonAttnBackend.forward called before init_forward_metadata(forward_batch)")
        return self.metadata

    def _num_kv_splits(self, batch_size: int, layer: "RadixAttention", device: torch.device, block_q: int = 1) -> int:
        if self.fixed_num_kv_splits is not None:
            return self.fixed_num_kv_splits
        return choose_num_kv_splits(batch_size, layer.num_kv_heads, layer.kv_group_size, device, block_q)

    def _scratch(self, num_tokens: int, layer: "RadixAttention", splits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-K partial outputs ``[T, H, S, Dv]`` and log2-sum-exps ``[T, H, S]``, views of one fp32 buffer."""
        rows = num_tokens * layer.num_heads * splits
        need = rows * (layer.v_head_dim + 1)
        buf = self._scratch_buf
        if buf is None or buf.numel() < need or buf.device != device:
            if buf is not None:
                self._retired_scratch.append(buf)  # a captured CUDA graph may still write into it
            size = need if buf is None else max(need, 2 * buf.numel())
            buf = self._scratch_buf = torch.empty(size, dtype=torch.float32, device=device)
        mid_o = buf[: rows * layer.v_head_dim].view(num_tokens, layer.num_heads, splits, layer.v_head_dim)
        mid_lse = buf[rows * layer.v_head_dim : need].view(num_tokens, layer.num_heads, splits)
        return mid_o, mid_lse

    @staticmethod
    def _paged_kv(
        layer: "RadixAttention", forward_batch: "ForwardBatch"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernels' paged-KV arguments: this layer's K and V pool buffers, req_to_token, the batch's pool rows."""
        pool = forward_batch.token_to_kv_pool
        return (
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
        )

    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """Split-K decode over ``req_to_token[row, :seq_len]``."""
        self._metadata_for(forward_batch)
        bs = forward_batch.batch_size
        q3 = q.reshape(bs, layer.num_heads, layer.head_dim)
        o = q.new_empty((bs, layer.num_heads, layer.v_head_dim))
        splits = self._num_kv_splits(bs, layer, q.device)
        mid_o, mid_lse = self._scratch(bs, layer, splits, q.device)
        decode_attention_fwd(
            q3,
            o,
            *self._paged_kv(layer, forward_batch),
            forward_batch.seq_lens,
            layer.scaling,
            splits,
            layer.sliding_window,
            mid_o,
            mid_lse,
        )
        return o.reshape(bs, layer.num_heads * layer.v_head_dim)

    def forward_extend(
        self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch", causal: bool
    ) -> torch.Tensor:
        """Split-K kernel for short blocks, else the paged extend kernel; ``causal=False`` for DRAFT_BLOCK."""
        meta = self._metadata_for(forward_batch)
        q3 = q.reshape(-1, layer.num_heads, layer.head_dim)
        o = q.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        if 0 < meta.max_extend_len <= self.split_block_max:
            bs = forward_batch.batch_size
            splits = self._num_kv_splits(bs, layer, q.device, triton.next_power_of_2(meta.max_extend_len))
            mid_o, mid_lse = self._scratch(q3.shape[0], layer, splits, q.device)
            block_split_attention_fwd(
                q3,
                o,
                *self._paged_kv(layer, forward_batch),
                forward_batch.seq_lens,
                forward_batch.extend_seq_lens,
                meta.q_start,
                meta.max_extend_len,
                layer.scaling,
                causal,
                splits,
                layer.sliding_window,
                mid_o,
                mid_lse,
            )
            return o.reshape(-1, layer.num_heads * layer.v_head_dim)
        extend_attention_fwd(
            q3,
            o,
            *self._paged_kv(layer, forward_batch),
            forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens,
            meta.q_start,
            meta.max_extend_len,
            layer.scaling,
            causal,
            layer.sliding_window,
        )
        return o.reshape(-1, layer.num_heads * layer.v_head_dim)
