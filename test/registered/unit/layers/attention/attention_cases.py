"""Random paged-attention cases shared by the attention tests (CPU and GPU).

A case holds each request's full, unpaged K/V (``dense_k`` / ``dense_v``), scatters the prefix part
into a real MHATokenToKVPool at a random page layout, and passes the new tokens' K/V as forward
inputs, so a backend must write them at ``out_cache_loc`` and read everything back through
``req_to_token``. Pool slots no request owns hold large garbage, so reading a wrong slot shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from sglite.srt.layers.attention.radix_attention import RadixAttention
from sglite.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, build_forward_batch


@dataclass
class AttnCase:
    """One batch: layer geometry, forward inputs and the unpaged K/V each request attends over."""

    forward_batch: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor  # [T, H*D]
    k: torch.Tensor  # [T, Hkv*D] new tokens
    v: torch.Tensor  # [T, Hkv*Dv]
    dense_k: list[torch.Tensor]  # per request [P+n, Hkv, D]
    dense_v: list[torch.Tensor]
    prefix_lens: list[int]
    extend_lens: list[int]


def build_case(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    v_head_dim: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    kv_dtype: Optional[torch.dtype] = None,
    device: str = "cpu",
    seed: int = 0,
    sliding_window: Optional[int] = None,
    layer_id: int = 1,
) -> AttnCase:
    """A random batch with each request's pages scattered over a shared pool (page 0 reserved).

    ``kv_dtype`` (default: ``dtype``) is the pool's dtype, e.g. an FP8 KV cache under fp16 queries.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 3  # a few spare pages, so the layout is not dense
    size = num_pages * page_size
    pool = MHATokenToKVPool(size, page_size, kv_dtype, num_kv_heads, head_dim, v_head_dim, layer_num=3, device=device)
    for buf in (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)):
        buf.copy_((torch.rand(buf.shape, generator=gen) * 200 + 100).to(kv_dtype))  # garbage: big, one-signed
    bs = len(seq_lens)
    r2t_pool = ReqToTokenPool(size=bs + 3, max_context_len=max(seq_lens) + 5, device=device)
    rows = (torch.randperm(bs + 3, generator=gen)[:bs] + 1).tolist()
    page_ids = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # slot ids start at page_size

    dense_k, dense_v, out_locs, reqs = [], [], [], []
    for i, (p, n, s) in enumerate(zip(prefix_lens, extend_lens, seq_lens)):
        mine, page_ids = page_ids[: pages_per_req[i]], page_ids[pages_per_req[i] :]
        pos = torch.arange(s)
        slots = torch.tensor(mine)[pos // page_size] * page_size + pos % page_size
        kd = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        vd = torch.randn(s, num_kv_heads, v_head_dim, generator=gen).to(dtype)
        dense_k.append(kd.to(device))
        dense_v.append(vd.to(device))
        r2t_pool.req_to_token[rows[i], :p] = slots[:p].to(r2t_pool.req_to_token.dtype).to(device)
        if p:
            pool.set_kv_buffer(layer_id, slots[:p].to(device), kd[:p].to(device), vd[:p].to(device))
        out_locs.append(slots[p:])
        reqs.append((rows[i], p, [0] * n))
    fb = build_forward_batch(
        mode,
        reqs,
        req_to_token_pool=r2t_pool,
        token_to_kv_pool=pool,
        out_cache_loc=torch.cat(out_locs).to(device),
        device=torch.device(device),
    )
    num_heads = num_kv_heads * group
    layer = RadixAttention(
        num_heads, head_dim, head_dim**-0.5, num_kv_heads, layer_id, v_head_dim=v_head_dim, sliding_window=sliding_window
    )
    total = sum(extend_lens)
    q = torch.randn(total, num_heads * head_dim, generator=gen).to(dtype).to(device)
    k = torch.cat([kd[p:] for kd, p in zip(dense_k, prefix_lens)]).reshape(total, -1)
    v = torch.cat([vd[p:] for vd, p in zip(dense_v, prefix_lens)]).reshape(total, -1)
    return AttnCase(fb, layer, q, k, v, dense_k, dense_v, list(prefix_lens), list(extend_lens))


def run_backend(backend: Any, case: AttnCase, save_kv_cache: bool = True) -> torch.Tensor:
    """Run one layer of ``case`` through ``backend`` via RadixAttention, as a model would."""
    case.forward_batch.attn_backend = backend
    backend.init_forward_metadata(case.forward_batch)
    return case.layer(case.q, case.k, case.v, case.forward_batch, save_kv_cache=save_kv_cache)


def dense_reference(case: AttnCase, causal: bool) -> torch.Tensor:
    """Plain SDPA over each request's unpaged K/V with an explicit mask (fp32) → ``[T, H*Dv]``."""
    layer = case.layer
    outs = []
    q3 = case.q.reshape(-1, layer.num_heads, layer.head_dim).float()
    start = 0
    for kd, vd, p, n in zip(case.dense_k, case.dense_v, case.prefix_lens, case.extend_lens):
        q_pos = torch.arange(p, p + n, device=q3.device)[:, None]
        k_pos = torch.arange(p + n, device=q3.device)[None, :]
        allowed = (k_pos <= q_pos) if causal else torch.ones(n, p + n, dtype=torch.bool, device=q3.device)
        if layer.sliding_window is not None:
            allowed = allowed & (q_pos - k_pos < layer.sliding_window)
        o = torch.nn.functional.scaled_dot_product_attention(
            q3[start : start + n].transpose(0, 1),
            kd.float().transpose(0, 1),
            vd.float().transpose(0, 1),
            attn_mask=allowed,
            scale=layer.scaling,
            enable_gqa=True,
        )
        outs.append(o.transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)
