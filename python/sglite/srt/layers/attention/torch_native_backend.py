"""Reference attention backend in plain torch: gather K/V through req_to_token into a padded batch and attend.

It favours being obviously right over speed (fp32 math, explicit masks); the Triton and flashinfer
backends are tested against it, and it is itself tested against dense attention on unpaged K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

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


def ragged_arange(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(starts[i], starts[i] + counts[i])`` over i, without a Python loop."""
    total = int(counts.sum())
    seg_begin = torch.cumsum(counts, 0) - counts  # where each range begins in the output
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(starts - seg_begin, counts, output_size=total)


class _BatchGroup:
    """Requests attended together in one padded call: index arrays and masks built once per forward."""

    def __init__(self, spans: RequestSpans, members: list[int], rows: torch.Tensor, req_to_token: torch.Tensor) -> None:
        self.device = req_to_token.device
        self.members = members
        self.prefix_list = [spans.prefix_lens[i] for i in members]
        self.extend_list = lens = [spans.extend_lens[i] for i in members]
        seq_list = [spans.seq_lens[i] for i in members]
        self.bs = len(members)
        self.max_q = max(lens)
        self.max_s = max(seq_list)
        # Every key slot of the padded table is a real key (equal lengths): no validity mask needed.
        self.all_keys_valid = min(seq_list) == self.max_s
        # Padded key slots read slot 0 (reserved, never a request's); the mask drops them. Flat, so each
        # layer gathers K and V with one index_select (far cheaper than advanced indexing on CPU).
        member_rows = rows if len(members) == rows.numel() else rows[members]
        slots = req_to_token[member_rows, : self.max_s].long()
        if not self.all_keys_valid:
            slots = slots.masked_fill_(~self.kv_valid, 0)
        self.kv_index = slots.reshape(-1)
        # Equal query counts over consecutive requests (decode, verify, draft blocks, one-request groups):
        # the packed queries already are the padded layout, so no scatter/gather is needed.
        consecutive = members == list(range(members[0], members[0] + len(members)))
        self.token_slice: Optional[slice] = None
        self.q_src: Optional[torch.Tensor] = None
        self.q_dst: Optional[torch.Tensor] = None
        if consecutive and all(n == self.max_q for n in lens):
            first = spans.q_starts[members[0]]
            self.token_slice = slice(first, first + self.max_q * len(members))
        else:
            # Query token t of member b sits at padded row b * max_q + i; q_src[t] is its packed index.
            q_starts = torch.tensor([spans.q_starts[i] for i in members], device=self.device)
            self.q_src = ragged_arange(q_starts, self._extend)
            self.q_dst = ragged_arange(torch.arange(len(members), device=self.device) * self.max_q, self._extend)
        # The largest query position: a sliding window no query can exceed masks nothing.
        self.max_q_pos = max(p + n - 1 for p, n in zip(self.prefix_list, lens))
        # Equal-length prompts with no cached prefix: the causal mask is SDPA's own ``is_causal`` (queries
        # and keys start together), which its CPU kernel runs faster than an explicit mask.
        self.plain_causal_ok = self.token_slice is not None and self.all_keys_valid and max(self.prefix_list) == 0
        self._masks: dict[tuple[bool, Optional[int], int], Optional[torch.Tensor]] = {}

    # Position tensors, built only when a mask needs them (an equal-length decode batch never does).
    @cached_property
    def _extend(self) -> torch.Tensor:
        return torch.tensor(self.extend_list, device=self.device)

    @cached_property
    def k_pos(self) -> torch.Tensor:
        """Key positions ``[1, 1, S]``."""
        return torch.arange(self.max_s, device=self.device)[None, None, :]

    @cached_property
    def kv_valid(self) -> torch.Tensor:
        """Boolean ``[bs, S]``: which padded key slots are real keys."""
        seq = torch.tensor([p + n for p, n in zip(self.prefix_list, self.extend_list)], device=self.device)
        return self.k_pos[0] < seq[:, None]

    @cached_property
    def q_valid(self) -> torch.Tensor:
        """Boolean ``[bs, Q]``: which padded query rows are real queries."""
        return torch.arange(self.max_q, device=self.device)[None, :] < self._extend[:, None]

    @cached_property
    def q_pos(self) -> torch.Tensor:
        """Query positions ``[bs, Q, 1]``."""
        prefix = torch.tensor(self.prefix_list, device=self.device)
        return (prefix[:, None] + torch.arange(self.max_q, device=self.device)[None, :])[:, :, None]

    def mask(self, causal: bool, sliding_window: Optional[int], group: int = 1) -> Optional[torch.Tensor]:
        """Boolean ``[bs, 1, group * Q, S]`` (cached): valid keys of each padded query; None = every key.

        ``group`` query heads share a KV head and are stacked along the query axis (row ``g * Q + i``),
        so each row repeats its query's mask ``group`` times.
        """
        key = (causal, sliding_window, group)
        if key not in self._masks:
            self._masks[key] = self._build_mask(causal, sliding_window, group)
        return self._masks[key]

    def _build_mask(self, causal: bool, sliding_window: Optional[int], group: int) -> Optional[torch.Tensor]:
        causal_clause = causal and self.max_q > 1  # one query per request sits last: causal = every valid key
        window_clause = sliding_window is not None and self.max_q_pos >= sliding_window
        if self.all_keys_valid and not causal_clause and not window_clause and self.token_slice is not None:
            return None  # decode / draft block over equal lengths: every key is visible
        m = self.kv_valid[:, None, :].expand(-1, self.max_q, -1)
        if causal_clause:
            m = m & (self.k_pos <= self.q_pos)
        if window_clause:
            m = m & (self.q_pos - self.k_pos < sliding_window)
        if self.token_slice is None:
            # Padded query rows see key 0 so their (discarded) softmax stays finite.
            pad_rows = ~self.q_valid[:, :, None] & (self.k_pos == 0)
            m = (m & self.q_valid[:, :, None]) | pad_rows
        if self.max_q == 1 or group == 1:
            return m[:, None]  # one query per request broadcasts over the stacked heads
        return m[:, None].expand(-1, group, -1, -1).reshape(self.bs, 1, group * self.max_q, -1)


def _group_requests(spans: RequestSpans, padding_limit: float) -> list[list[int]]:
    """Requests split into padded groups whose score work stays within ``padding_limit`` x the real work.

    A mixed batch (prompts plus decoding requests, ``--enable-mixed-chunk``) first splits into its
    one-query requests and the rest, so decoding rows take the decode path (no padding to a prompt's
    query count) and every row computes exactly what a separate DECODE / EXTEND batch would.
    Each part is usually one group; a ragged part (one long sequence among short ones) is cut into
    groups of similar lengths, taken longest first, so padding never multiplies memory unboundedly.
    """
    decoding = [i for i, q in enumerate(spans.extend_lens) if q == 1]
    if 0 < len(decoding) < len(spans.extend_lens):
        prefilling = [i for i, q in enumerate(spans.extend_lens) if q > 1]
        return _length_groups(spans, prefilling, padding_limit) + _length_groups(spans, decoding, padding_limit)
    return _length_groups(spans, list(range(len(spans.extend_lens))), padding_limit)


def _length_groups(spans: RequestSpans, members: list[int], padding_limit: float) -> list[list[int]]:
    """``members`` in one group, or cut by length (longest first) where padding would pass ``padding_limit``."""
    q_lens = [spans.extend_lens[i] for i in members]
    s_lens = [spans.seq_lens[i] for i in members]
    work = {i: spans.extend_lens[i] * spans.seq_lens[i] for i in members}
    if len(members) * max(q_lens) * max(s_lens) <= padding_limit * sum(work.values()):
        return [members]
    order = sorted(members, key=lambda i: (spans.seq_lens[i], spans.extend_lens[i]), reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_q = cur_s = cur_work = 0
    for i in order:
        q, s = max(cur_q, spans.extend_lens[i]), max(cur_s, spans.seq_lens[i])
        if cur and (len(cur) + 1) * q * s > padding_limit * (cur_work + work[i]):
            groups.append(sorted(cur))
            cur, q, s, cur_work = [], spans.extend_lens[i], spans.seq_lens[i], 0
        cur.append(i)
        cur_q, cur_s, cur_work = q, s, cur_work + work[i]
    groups.append(sorted(cur))
    return groups


def _as_fp32(x: torch.Tensor) -> torch.Tensor:
    # A dtype check instead of a no-op .float(): each op call costs a dispatch on a CPU decode step.
    return x if x.dtype == torch.float32 else x.float()


def _group_kv(buf: torch.Tensor, group: "_BatchGroup") -> torch.Tensor:
    """The group's keys (or values) of one layer as fp32 ``[bs, Hkv, S, D]``: one gather, then strided views."""
    rows = buf.index_select(0, group.kv_index)
    return _as_fp32(rows.view(group.bs, group.max_s, buf.shape[1], -1).transpose(1, 2))


def batched_attention(
    q3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: _BatchGroup, causal: bool, layer: "RadixAttention"
) -> torch.Tensor:
    """One masked fp32 attention over a padded group → ``[tokens of group, H, Dv]`` in packed order.

    K/V are gathered once (one ``index_select`` each) and handed to SDPA as strided ``[bs, Hkv, S, D]``
    views, so nothing is copied again for the matmuls. GQA without repeating K/V: the G query heads
    sharing a KV head are stacked along the query axis (faster on CPU than SDPA's ``enable_gqa``).
    """
    bs, max_q, max_s = group.bs, group.max_q, group.max_s
    num_heads, head_dim = q3.shape[1], q3.shape[2]
    kv_heads = k_buf.shape[1]
    g = num_heads // kv_heads
    k, v = _group_kv(k_buf, group), _group_kv(v_buf, group)
    window = layer.sliding_window
    if max_q == 1 and group.token_slice is not None:
        # Decode: one query per request, already in padded order. The same views as the general path
        # below (so the same SDPA inputs, bit for bit) in a third of its ops; each op pays a dispatch
        # with caches cold from the GEMMs (docs/benchmarks.md, "SmolLM2 decode profile").
        qp = q3 if group.token_slice.stop - group.token_slice.start == q3.shape[0] else q3[group.token_slice]
        qp = _as_fp32(qp).view(bs, kv_heads, g, head_dim)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=group.mask(causal, window, g), scale=layer.scaling)
        return o.reshape(bs, num_heads, o.shape[-1])  # [bs, Hkv, G, Dv] in head order h = kv_head * G + g
    if group.token_slice is not None:
        qp = _as_fp32(q3[group.token_slice])
    else:
        qp = q3.new_zeros((bs * max_q, num_heads, head_dim), dtype=torch.float32)
        qp[group.q_dst] = q3[group.q_src].float()
    if causal and max_q > 1 and group.plain_causal_ok and (window is None or group.max_q_pos < window):
        qh = qp.view(bs, max_q, num_heads, head_dim).transpose(1, 2)  # [bs, H, Q, D]
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=layer.scaling, enable_gqa=g > 1)
        return o.transpose(1, 2).reshape(bs * max_q, num_heads, o.shape[-1])
    # [bs, Q, Hkv, G, D] -> [bs, Hkv, G*Q, D] (a view when Q == 1)
    qp = qp.view(bs, max_q, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, g * max_q, head_dim)
    mask = group.mask(causal, window, g)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=layer.scaling)  # [bs, Hkv, G*Q, Dv]
    dv = o.shape[-1]
    o = o.view(bs, kv_heads, g, max_q, dv).permute(0, 3, 1, 2, 4).reshape(bs * max_q, num_heads, dv)
    return o if group.token_slice is not None else o[group.q_dst]


class TorchNativeAttnBackend(AttentionBackend):
    """Padded-batch gather + fp32 softmax attention over the paged pool; works on any device.

    Per forward, ``init_forward_metadata`` builds the padded KV slot table and masks once; each layer
    then does one gather and one masked attention for the whole batch.
    """

    # Batches whose padding would cost more than this factor of the real score work are split into
    # groups of similar lengths (keeps one long prompt plus many short ones from blowing up memory).
    padding_limit: float = 4.0
    # Not graph-safe: metadata comes from host lists and has data-dependent shapes (padded to max seq_len).
    supports_cuda_graph = False

    def __init__(self, runner: Any = None) -> None:
        self.runner = runner
        self._spans: Optional[RequestSpans] = None
        self._groups: list[_BatchGroup] = []

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Read the per-request lengths and build the padded gather indices and masks once per batch."""
        if mode_name(forward_batch) == "IDLE":
            self._spans, self._groups = None, []
            return
        spans = request_spans(forward_batch)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.to(req_to_token.device).long()
        self._groups = [
            _BatchGroup(spans, members, rows, req_to_token) for members in _group_requests(spans, self.padding_limit)
        ]
        self._spans = spans

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
        """Attend each request's new queries over ``req_to_token[row, :seq_len]``, one call per group."""
        self._spans_for(forward_batch)
        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = forward_batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q3 = q.reshape(-1, layer.num_heads, layer.head_dim)
        if len(self._groups) == 1:
            g = self._groups[0]
            o = batched_attention(q3, k_buf, v_buf, g, causal, layer)
            if o.dtype != q.dtype:
                o = o.to(q.dtype)
            return o.reshape(-1, layer.num_heads * layer.v_head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        for g in self._groups:
            o = batched_attention(q3, k_buf, v_buf, g, causal, layer)
            out[g.token_slice if g.token_slice is not None else g.q_src] = o.to(out.dtype)
        return out.reshape(-1, layer.num_heads * layer.v_head_dim)
