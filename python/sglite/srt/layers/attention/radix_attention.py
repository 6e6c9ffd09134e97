"""RadixAttention: the attention layer module models hold; it forwards to the batch's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from sglite.srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    """Per-layer attention geometry; the math lives in ``forward_batch.attn_backend``.

    ``num_heads`` / ``num_kv_heads`` are this rank's heads (after TP sharding). ``sliding_window`` is
    the HF convention: a query at position p sees keys k with ``p - k < sliding_window``; None = full.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        v_head_dim: Optional[int] = None,
        sliding_window: Optional[int] = None,
        mla_rope_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"layer {layer_id}: num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"layer {layer_id}: sliding_window must be >= 1 or None (got {sliding_window})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        # MLA with absorbed weights: one KV head whose key is [compressed KV (v_head_dim) | rope key (mla_rope_dim)]
        # and whose value is the compressed part. Backends with dedicated MLA kernels (flashinfer) read it.
        self.mla_rope_dim = mla_rope_dim
        if mla_rope_dim is not None and (num_kv_heads != 1 or self.v_head_dim + mla_rope_dim != head_dim):
            raise ValueError(f"layer {layer_id}: an MLA layer has one KV head of v_head_dim + mla_rope_dim = head_dim")

    @property
    def kv_group_size(self) -> int:
        """Query heads per KV head (GQA ratio); query head h uses KV head ``h // kv_group_size``."""
        return self.num_heads // self.num_kv_heads

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q ``[T, H*D]``, k ``[T, Hkv*D]``, v ``[T, Hkv*Dv]`` (or per-head ``[T, heads, dim]``) → o ``[T, H*Dv]``."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache=save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, sliding_window={self.sliding_window}"
        )
