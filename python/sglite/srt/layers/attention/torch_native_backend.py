"""Reference attention backend in plain torch: per request, gather K/V through req_to_token and attend.

It favours being obviously right over speed (fp32 math, explicit masks); the Triton and flashinfer
backends are tested against it, and it is itself tested against dense attention on unpaged K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglite.srt.layers.attention.base_attn_backend import AttentionBackend, cpu_list, mode_name

if TYPE_CHECKING:
    from sglite.srt.layers.attention.radix_attention import RadixAttention
    from sglite.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class RequestSpans:
    """Per-request spans of one batch: prefix length, new tokens, total KV length, q offset."""

    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    q_starts: list[int]


def request_spans(forward_batch: "ForwardBatch") -> RequestSpans:
    """Prefix/new/total lengths per request, checked to satisfy ``seq_len == prefix + new``."""
    seq_lens = cpu_list(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
    if mode_name(forward_batch) == "DECODE":
        extend_lens = [1] * len(seq_lens)
        prefix_lens = [s - 1 for s in seq_lens]
    else:
        extend_lens = cpu_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
        prefix_lens = cpu_list(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
    for i, (p, n, s) in enumerate(zip(prefix_lens, extend_lens, seq_lens)):
        if p + n != s or n < 1:
            raise ValueError(f"request {i}: seq_len {s} != prefix {p} + new tokens {n} (or no new tokens)")
    q_starts, acc = [], 0
    for n in extend_lens:
        q_starts.append(acc)
        acc += n
    return RequestSpans(prefix_lens, extend_lens, seq_lens, q_starts)


def attention_mask(
    prefix_len: int, num_new: int, causal: bool, sliding_window: Optional[int], device: torch.device
) -> torch.Tensor:
    """Boolean ``[num_new, prefix_len + num_new]``: which keys each new query sees."""
    q_pos = prefix_len + torch.arange(num_new, device=device)[:, None]
    k_pos = torch.arange(prefix_len + num_new, device=device)[None, :]
    mask = k_pos <= q_pos if causal else torch.ones(num_new, prefix_len + num_new, dtype=torch.bool, device=device)
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    return mask


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q ``[n, H, D]``, k ``[S, Hkv, D]``, v ``[S, Hkv, Dv]``, mask ``[n, S]`` → ``[n, H, Dv]`` in fp32 (GQA by repeat)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), kf) * scaling
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hns,shd->nhd", probs, vf)


class TorchNativeAttnBackend(AttentionBackend):
    """Per-request gather + fp32 softmax attention over the paged pool; works on any device."""

    def __init__(self, runner: Any = None) -> None:
        self.runner = runner
        self._spans: Optional[RequestSpans] = None

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Read the per-request lengths once per batch."""
        self._spans = None if mode_name(forward_batch) == "IDLE" else request_spans(forward_batch)

    def _spans_for(self, forward_batch: "ForwardBatch") -> RequestSpans:
        if self._spans is None:
            raise RuntimeError("TorchNativeAttnBackend.forward called before init_forward_metadata(forward_batch)")
        return self._spans

    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """Decode is extend with one causal token per request."""
        return self.forward_extend(q, layer, forward_batch, causal=True)

    def forward_extend(
        self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch", causal: bool
    ) -> torch.Tensor:
        """Attend each request's new queries over ``req_to_token[row, :seq_len]``."""
        spans = self._spans_for(forward_batch)
        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = forward_batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        q3 = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        for i, row in enumerate(rows):
            p, n, s, qs = spans.prefix_lens[i], spans.extend_lens[i], spans.seq_lens[i], spans.q_starts[i]
            slots = req_to_token[row, :s].long()
            mask = attention_mask(p, n, causal, layer.sliding_window, q.device)
            o = dense_attention(q3[qs : qs + n], k_buf[slots], v_buf[slots], mask, layer.scaling)
            out[qs : qs + n] = o.to(out.dtype)
        return out.reshape(-1, layer.num_heads * layer.v_head_dim)
