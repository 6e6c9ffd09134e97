"""Paged causal attention in plain torch ops (decode, prefill, mixed and verify forwards), for an Inductor-compiled
step.

Eager CPU decode attention (``torch_native_backend``) gathers each layer's K and V rows into padded
copies and runs SDPA once per (request, KV head); at batch 32 that is ~20% of a SmolLM2 step. Traced
by ``torch.compile`` instead, the formulation below lets Inductor read the K/V rows through the slot
table inside its generated loops (no gathered copy) and fuse the scaling, mask and softmax into them
(docs/benchmarks.md, "Compiled CPU decode"). Run eagerly it is slower than SDPA, so only the compiled
decode step (``model_executor/compiled_decode_runner.py``) uses it.

Invariants: each request's new tokens (one in a decode step; a prompt chunk, a verify block or one decode
token in a mixed step) are causal among themselves; the pool stores K/V in the model's dtype (no fp8
scaling); the slot table row of request ``b`` holds its ``seq_lens[b]`` keys in order, its new tokens'
slots last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglite.srt.layers.attention import cpu_paged_attention  # noqa: F401 - registers sglite::paged_attention

if TYPE_CHECKING:
    from sglite.srt.layers.attention.radix_attention import RadixAttention


@dataclass
class DecodeSlots:
    """The slot table of a compiled forward's new tokens: what the graph reads instead of a ForwardBatch.

    A decode step leaves ``token_rows`` and ``token_key_index`` None: one new token a request, the last of its keys.
    A forward of several new tokens a request (a prefill, a mixed prefill + decode step, a verify block) gives each
    new token its request's row and its own key index, so requests may bring different numbers of them.
    """

    kv_indices: torch.Tensor  # [B, L] int64: slot of key l of request b (entries past seq_len: any valid slot)
    seq_lens: torch.Tensor  # [B] int64: keys per request, its new tokens included (last)
    out_cache_loc: torch.Tensor  # [T] int64: the new tokens' slots, request-major
    token_rows: Optional[torch.Tensor] = None  # [T] int64: the request (row of kv_indices) of each new token
    token_key_index: Optional[torch.Tensor] = None  # [T] int64: each new token's own key index in its row


@dataclass
class TracedDecodeBatch:
    """The fields a Llama-family model forward reads from its batch, for a compiled decode step."""

    attn_backend: "CompiledDecodeAttention"
    slots: DecodeSlots
    capture_aux_hidden_layers: Optional[list[int]] = None


def paged_causal_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: DecodeSlots,
    scaling: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """o ``[T, H, Dv]`` for queries ``[T, H, D]``: each new token attends causally over its request's keys.

    Request b's keys are ``k_cache[kv_indices[b, :seq_lens[b]]]``, its new tokens last. New token t reads row
    ``token_rows[t]`` and sees its keys up to index ``token_key_index[t]`` (its own); a decode step (both None)
    reads row t up to its last key. fp32 scores and softmax (as the reference backend). Query head h reads KV
    head ``h // (H // Hkv)``. A sliding window keeps keys at positions ``> query position - window`` (the HF
    rule).
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    decode = slots.token_rows is None
    rows = slots.kv_indices if decode else slots.kv_indices[slots.token_rows]  # [T, L]
    query_pos = (slots.seq_lens - 1 if decode else slots.token_key_index)[:, None]  # [T, 1]
    keys = k_cache[rows].float()  # [T, L, Hkv, D]: Inductor fuses this gather into its loads
    values = v_cache[rows].float()
    qg = q.float().reshape(tokens, 1, num_kv_heads, group, head_dim)
    scores = (keys[:, :, :, None, :] * qg).sum(-1) * scaling  # [T, L, Hkv, G]
    key_pos = torch.arange(rows.shape[1], device=q.device)[None, :]
    invalid = key_pos > query_pos
    if sliding_window is not None:
        invalid = invalid | (key_pos <= query_pos - sliding_window)
    scores = scores.masked_fill(invalid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs.unsqueeze(-1) * values[:, :, :, None, :]).sum(1)  # [T, Hkv, G, Dv]
    return out.reshape(tokens, num_heads, values.shape[-1]).to(q.dtype)


# K/V dtypes whose rows the compiled attention can hand the fp32 C++ kernel: fp32 in place, bf16 widened per forward.
KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_reads_in_place(kv_dtype: torch.dtype) -> bool:
    """Whether the kernel reads a pool of this dtype as it is (fp32) rather than a widened fp32 copy of its rows."""
    return kv_dtype == torch.float32


class CompiledDecodeAttention:
    """The attention backend a compiled forward's model calls: K/V write, then paged attention (the C++ kernel
    ``sglite::paged_attention`` for forwards of several new tokens a request when ``use_kernel``, on fp32 rows, else
    ``paged_causal_attention``)."""

    def __init__(self, token_to_kv_pool: Any, use_kernel: bool) -> None:
        self.token_to_kv_pool = token_to_kv_pool
        # The C++ kernel serves every layer's attention (cpu_paged_attention.kernel_serves), decided before tracing.
        self.use_kernel = use_kernel

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
        tokens = q.shape[0]
        if save_kv_cache:
            # index_put_ on the pool buffer: Inductor writes the rows in place (no copy of the buffer).
            k_cache.index_put_((slots.out_cache_loc,), k.reshape(tokens, layer.num_kv_heads, layer.head_dim))
            v_cache.index_put_((slots.out_cache_loc,), v.reshape(tokens, layer.num_kv_heads, layer.v_head_dim))
        q = q.reshape(tokens, layer.num_heads, layer.head_dim)
        if self.use_kernel and slots.token_rows is not None:
            # Forwards of several new tokens a request: the torch formulation reads every key of the longest sequence
            # for each new token, and a prompt's tokens each re-read their request's keys. A decode step reads each
            # request's keys once either way, and there Inductor's fused loop matched or beat the kernel
            # (docs/benchmarks.md, "A paged attention kernel for prefills, mixed steps and verify blocks").
            o = self._kernel_attention(q, k_cache, v_cache, slots, layer)
        else:
            o = paged_causal_attention(q, k_cache, v_cache, slots, layer.scaling, layer.sliding_window)
        return o.reshape(tokens, layer.num_heads * layer.v_head_dim)

    @staticmethod
    def widened_elements_per_key(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
        """fp32 elements one key adds to the copy ``_kernel_attention`` makes of a pool's rows (0: read in place)."""
        return 0 if _kernel_reads_in_place(k_cache.dtype) else k_cache.shape[1] * (k_cache.shape[2] + v_cache.shape[2])

    @staticmethod
    def _kernel_attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: DecodeSlots, layer: "RadixAttention"
    ) -> torch.Tensor:
        """``sglite::paged_attention`` over the pool's fp32 rows in place; a bf16 pool's rows of this forward are first
        widened into one fp32 copy (the batch's keys, a few per prompt token: exact, and cheap beside the attention
        the kernel saves; docs/benchmarks.md, "bf16 on CPU")."""
        kv_indices = slots.kv_indices
        if not _kernel_reads_in_place(k_cache.dtype):
            requests, keys = kv_indices.shape
            k_cache = k_cache[kv_indices].reshape(requests * keys, *k_cache.shape[1:]).float()
            v_cache = v_cache[kv_indices].reshape(requests * keys, *v_cache.shape[1:]).float()
            kv_indices = torch.arange(requests * keys, device=q.device).reshape(requests, keys)
        o = torch.ops.sglite.paged_attention(
            q.float(), k_cache, v_cache, kv_indices, slots.seq_lens, slots.token_rows, slots.token_key_index,
            layer.scaling, layer.sliding_window or 0,
        )
        return o.to(q.dtype)
