"""The attention-backend interface every backend implements (docs/internals.md, "Model execution").

A backend receives the new tokens' q/k/v of one layer, writes k/v into the paged KV pool at
``forward_batch.out_cache_loc`` and attends each request's queries over ``req_to_token[row, :seq_len]``.
Semantics per request with prefix length P and n new tokens (new query i sits at position P+i):
EXTEND / DECODE / TARGET_VERIFY are causal (query i sees keys ``[0, P+i]``); DRAFT_BLOCK is non-causal
inside the block (every query sees keys ``[0, P+n)``). With a sliding window W a query at position p
additionally sees only keys at positions k with ``p - k < W`` (HF ``sliding_window`` convention).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported for type hints only; the modules import this one
    from sglite.srt.layers.attention.radix_attention import RadixAttention
    from sglite.srt.model_executor.forward_batch_info import ForwardBatch


def mode_name(forward_batch: "ForwardBatch") -> str:
    """Name of the batch's forward mode (``EXTEND``, ``DECODE``, ``TARGET_VERIFY``, ``DRAFT_BLOCK``, ``IDLE``)."""
    return forward_batch.forward_mode.name


def is_causal_mode(forward_batch: "ForwardBatch") -> bool:
    """True for EXTEND/DECODE/TARGET_VERIFY; False for DRAFT_BLOCK (non-causal inside the block)."""
    name = mode_name(forward_batch)
    if name in ("EXTEND", "DECODE", "TARGET_VERIFY"):
        return True
    if name == "DRAFT_BLOCK":
        return False
    raise ValueError(f"attention has no semantics for forward mode {name}")


def cpu_list(values: object, fallback: torch.Tensor) -> list[int]:
    """A per-request python list: the ``*_cpu`` field when the batch carries it, else the device tensor's values."""
    if values is not None:
        return [int(x) for x in values]  # type: ignore[union-attr]
    return [int(x) for x in fallback.tolist()]


class AttentionBackend(ABC):
    """Base class: dispatches ``forward`` to the decode or the extend-family path.

    CUDA graphs (``model_executor/cuda_graph_runner.py``): a backend that can be captured sets
    ``supports_cuda_graph = True`` and implements the three ``*cuda_graph*`` hooks. Capture and replay
    hand it a ForwardBatch whose tensors are the graph runner's static buffers (pad requests included);
    its metadata must live in persistent buffers, and the replay hook refreshes them in place from
    those device tensors with no host sync (no ``.item()``/``.tolist()``, no data-dependent shapes).
    """

    # Whether forwards through this backend can be captured in CUDA graphs.
    supports_cuda_graph: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Prepare per-batch metadata (index arrays, plans) once before the layers run."""

    def _no_cuda_graph(self) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__} cannot be captured in CUDA graphs (supports_cuda_graph is False)")

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the persistent metadata buffers for graphs of up to ``max_bs`` requests / ``max_num_tokens`` tokens."""
        raise self._no_cuda_graph()

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """Metadata for capturing this static batch (called before capture, outside the graph)."""
        raise self._no_cuda_graph()

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """Refresh the persistent metadata in place for a replay of this static batch (outside the graph)."""
        raise self._no_cuda_graph()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Write k/v at ``out_cache_loc`` (when ``save_kv_cache``) and attend; q ``[T, H*D]`` → o ``[T, H*Dv]``."""
        name = mode_name(forward_batch)
        if name == "IDLE":
            return q.new_empty((0, layer.num_heads * layer.v_head_dim))
        if save_kv_cache:
            self.save_kv(k, v, layer, forward_batch)
        if name == "DECODE":
            return self.forward_decode(q, layer, forward_batch)
        return self.forward_extend(q, layer, forward_batch, causal=is_causal_mode(forward_batch))

    def save_kv(self, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> None:
        """Write the new tokens' K/V into the layer's pool buffers at ``out_cache_loc``."""
        # The pool reshapes ``[n, heads*dim]`` rows itself (and checks their size).
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """One new token per request; keys ``req_to_token[row, :seq_len]`` (the new one included)."""

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch", causal: bool
    ) -> torch.Tensor:
        """n new tokens per request over prefix + new keys; ``causal=False`` for DRAFT_BLOCK."""
