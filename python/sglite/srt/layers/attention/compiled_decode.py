"""Decode attention in plain torch ops over the paged pool, written for an Inductor-compiled decode step.

Eager CPU decode attention (``torch_native_backend``) gathers each layer's K and V rows into padded
copies and runs SDPA once per (request, KV head); at batch 32 that is ~20% of a SmolLM2 step. Traced
by ``torch.compile`` instead, the formulation below lets Inductor read the K/V rows through the slot
table inside its generated loops (no gathered copy) and fuse the scaling, mask and softmax into them
(docs/benchmarks.md, "Compiled CPU decode"). Run eagerly it is slower than SDPA, so only the compiled
decode step (``model_executor/compiled_decode_runner.py``) uses it.

Invariants: one new token per request; the pool stores K/V in the model's dtype (no fp8 scaling); the
slot table row of request ``b`` holds its ``seq_lens[b]`` keys in order, the new token's slot last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from sglite.srt.layers.attention.radix_attention import RadixAttention


@dataclass
class DecodeSlots:
    """One decode step's slot table: what the compiled forward reads instead of a ForwardBatch."""

    kv_indices: torch.Tensor  # [B, L] int64: slot of key l of request b (entries past seq_len: any valid slot)
    seq_lens: torch.Tensor  # [B] int64: keys per request, the new token included
    out_cache_loc: torch.Tensor  # [B] int64: the new tokens' slots


@dataclass
class TracedDecodeBatch:
    """The fields a Llama-family model forward reads from its batch, for a compiled decode step."""

    attn_backend: "CompiledDecodeAttention"
    slots: DecodeSlots
    capture_aux_hidden_layers: Optional[list[int]] = None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: DecodeSlots,
    scaling: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """o ``[B, H, Dv]`` for queries ``[B, H, D]`` over each request's keys ``k_cache[kv_indices[b, :seq_lens[b]]]``.

    fp32 scores and softmax (as the reference backend). Query head h reads KV head ``h // (H // Hkv)``.
    A sliding window keeps keys at positions ``>= seq_len - window`` (the HF rule, query at seq_len - 1).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = k_cache[slots.kv_indices].float()  # [B, L, Hkv, D]: Inductor fuses this gather into its loads
    values = v_cache[slots.kv_indices].float()
    qg = q.float().reshape(bs, 1, num_kv_heads, group, head_dim)
    scores = (keys.unsqueeze(3) * qg).sum(-1) * scaling  # [B, L, Hkv, G]
    key_pos = torch.arange(slots.kv_indices.shape[1], device=q.device)[None, :]
    seq_lens = slots.seq_lens[:, None]
    invalid = key_pos >= seq_lens
    if sliding_window is not None:
        invalid = invalid | (key_pos < seq_lens - sliding_window)
    scores = scores.masked_fill(invalid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs.unsqueeze(-1) * values.unsqueeze(3)).sum(1)  # [B, Hkv, G, Dv]
    return out.reshape(bs, num_heads, values.shape[-1]).to(q.dtype)


class CompiledDecodeAttention:
    """The attention backend a compiled decode step's model forward calls: K/V write, then paged attention."""

    def __init__(self, token_to_kv_pool: Any) -> None:
        self.token_to_kv_pool = token_to_kv_pool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: TracedDecodeBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Write the new tokens' K/V at their slots and attend; q/k/v as RadixAttention takes them."""
        # The pool's own buffers: stored in the model dtype (checked at start-up), so no view or copy.
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        slots = forward_batch.slots
        bs = q.shape[0]
        if save_kv_cache:
            # index_put_ on the pool buffer: Inductor writes the rows in place (no copy of the buffer).
            k_cache.index_put_((slots.out_cache_loc,), k.reshape(bs, layer.num_kv_heads, layer.head_dim))
            v_cache.index_put_((slots.out_cache_loc,), v.reshape(bs, layer.num_kv_heads, layer.v_head_dim))
        o = paged_decode_attention(
            q.reshape(bs, layer.num_heads, layer.head_dim), k_cache, v_cache, slots, layer.scaling, layer.sliding_window
        )
        return o.reshape(bs, layer.num_heads * layer.v_head_dim)
