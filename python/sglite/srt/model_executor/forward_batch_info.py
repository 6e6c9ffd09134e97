"""ForwardMode and ForwardBatch: what one model forward computes, and where its K/V go.

Invariant (docs/internals.md): before a forward the caller has written ``out_cache_loc`` into
``req_to_token[row, prefix_len:seq_len]``, so a request's keys are always ``req_to_token[row, :seq_len]``.
``build_forward_batch`` does exactly that for a list of (req_row, prefix_len, new_token_ids).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


class ForwardMode(enum.IntEnum):
    """What kind of forward runs; it fixes the attention mask and which rows get logits."""

    EXTEND = 1  # prefill new tokens on top of a cached prefix (causal)
    DECODE = 2  # one new token per request (causal)
    TARGET_VERIFY = 3  # B draft tokens per request, causal inside the block; logits for every token
    DRAFT_BLOCK = 4  # B tokens per request, non-causal inside the block, over context KV
    IDLE = 5  # no tokens on this rank (DP attention keeps collectives in step)

    def is_extend(self) -> bool:
        """Prefill on top of a prefix."""
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        """One token per request."""
        return self == ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        """Causal verification of a draft block."""
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_block(self) -> bool:
        """Non-causal draft block."""
        return self == ForwardMode.DRAFT_BLOCK

    def is_idle(self) -> bool:
        """No tokens."""
        return self == ForwardMode.IDLE

    def is_causal(self) -> bool:
        """Whether a new query sees only keys up to its own position."""
        return self != ForwardMode.DRAFT_BLOCK

    def returns_all_token_logits(self) -> bool:
        """VERIFY / DRAFT_BLOCK produce one logits row per token; EXTEND / DECODE one per request."""
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK)


@dataclass
class ForwardBatch:
    """One forward's inputs and KV addressing (fields per docs/internals.md)."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs], KV length after this forward
    extend_prefix_lens: torch.Tensor  # [bs], KV length before
    extend_seq_lens: torch.Tensor  # [bs], new tokens per request
    out_cache_loc: torch.Tensor  # [T], slots the new tokens' K/V are written to
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: Any = None  # ReqToTokenPool
    token_to_kv_pool: Any = None  # MHATokenToKVPool (or another token->KV pool)
    attn_backend: Any = None  # AttentionBackend
    capture_aux_hidden_layers: Optional[list[int]] = None
    input_embeds: Optional[torch.Tensor] = None  # [T, hidden]; replaces the embedding lookup
    # EXTEND only: also return the logits of every new token (prompt logprobs, ``logprob_start_len``).
    return_extend_logits: bool = False

    def aux_layers(self) -> Optional[list[int]]:
        """The layers whose hidden states this forward captures, as a list; None when none (``[]`` included)."""
        return list(self.capture_aux_hidden_layers) if self.capture_aux_hidden_layers else None

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens in this forward."""
        return int(self.input_ids.shape[0]) if self.input_embeds is None else int(self.input_embeds.shape[0])


@dataclass(frozen=True)
class ReqForward:
    """One request's part of a forward: its req_to_token row, cached prefix length and new tokens."""

    req_row: int
    prefix_len: int
    new_token_ids: Sequence[int]


def build_forward_batch(
    mode: ForwardMode,
    reqs: Sequence[Any],
    *,
    req_to_token_pool: Any,
    token_to_kv_pool: Any,
    allocator: Any = None,
    attn_backend: Any = None,
    out_cache_loc: Optional[torch.Tensor] = None,
    capture_aux_hidden_layers: Optional[list[int]] = None,
    input_embeds: Optional[torch.Tensor] = None,
    device: Optional[torch.device] = None,
) -> ForwardBatch:
    """Build a ForwardBatch for (req_row, prefix_len, new_token_ids) triples (or ReqForward objects).

    Slots for the new tokens come from ``out_cache_loc`` when given, else from ``allocator.alloc_extend``
    (an exhausted allocator is an error). The slots are written into ``req_to_token`` before returning,
    so the prefix part of each row must already hold the request's cached slots.
    """
    if not reqs:
        raise ValueError("build_forward_batch needs at least one request (use ForwardMode.IDLE paths elsewhere)")
    # Plain python lists in one pass (no per-request objects): this runs every decode step.
    rows: list[int] = []
    prefix: list[int] = []
    new_ids: list[list[int]] = []
    for r in reqs:
        row, pre, ids = (r.req_row, r.prefix_len, r.new_token_ids) if isinstance(r, ReqForward) else r
        rows.append(int(row))
        prefix.append(int(pre))
        new_ids.append(ids if isinstance(ids, list) else ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))
    bs = len(rows)
    extend = [len(ids) for ids in new_ids]
    seq = [p + n for p, n in zip(prefix, extend)]
    one_each = all(n == 1 for n in extend)
    if mode == ForwardMode.DECODE and not one_each:
        raise ValueError(f"DECODE takes exactly one new token per request, got {extend}")
    if min(extend) < 1:
        raise ValueError(f"every request needs at least one new token, got {extend}")
    if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK) and len(set(extend)) != 1:
        raise ValueError(f"{mode.name} needs the same block size for every request, got {extend}")
    table = req_to_token_pool.req_to_token
    dev = torch.device(device) if device is not None else table.device
    max_ctx = table.shape[1]
    if max(seq) > max_ctx:
        raise ValueError(f"a request reaches {max(seq)} tokens but req_to_token holds {max_ctx} per row")
    total = sum(extend)
    if out_cache_loc is None:
        if allocator is None:
            raise ValueError("build_forward_batch needs an allocator or an explicit out_cache_loc")
        if getattr(allocator, "page_size", None) == 1:
            last_locs = [0] * bs  # no page tails to fill: the allocator never reads them
        else:
            # One gather for every request's last cached slot (0 where there is no prefix).
            row_t = torch.tensor(rows, dtype=torch.int64, device=table.device)
            pre_t = torch.tensor(prefix, dtype=torch.int64, device=table.device)
            last_t = table[row_t, (pre_t - 1).clamp_min(0)].to(torch.int64)
            last_locs = torch.where(pre_t > 0, last_t, torch.zeros_like(last_t)).tolist()
        out_cache_loc = allocator.alloc_extend(prefix, seq, last_locs)
        if out_cache_loc is None:
            raise RuntimeError(
                f"KV pool exhausted: {total} new tokens requested, {allocator.available_size()} slots free"
            )
    if out_cache_loc.numel() != total:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots for {total} new tokens")
    out_cache_loc = out_cache_loc.to(dev, torch.int64)
    # Token j of request i sits at position prefix[i] + j. Python lists, then ONE host tensor holding
    # every per-token and per-request field (one transfer on an accelerator); the fields are views of it.
    if one_each:
        positions_list, token_rows, input_list = prefix, rows, [ids[0] for ids in new_ids]
    else:
        positions_list = [p + j for p, n in zip(prefix, extend) for j in range(n)]
        token_rows = [row for row, n in zip(rows, extend) for _ in range(n)]
        input_list = [t for ids in new_ids for t in ids]
    packed = torch.tensor(
        positions_list + input_list + token_rows + rows + seq + prefix + extend, dtype=torch.int64
    )
    # One scatter writes every new slot into its request's row.
    table_packed = packed if table.device == packed.device else packed.to(table.device)
    table[table_packed[2 * total : 3 * total], table_packed[:total]] = out_cache_loc.to(table.device, table.dtype)
    packed = packed if packed.device == dev else packed.to(dev)
    fields = packed[3 * total :].view(4, bs)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=packed[total : 2 * total],
        positions=packed[:total],
        req_pool_indices=fields[0],
        seq_lens=fields[1],
        extend_prefix_lens=fields[2],
        extend_seq_lens=fields[3],
        out_cache_loc=out_cache_loc,
        seq_lens_cpu=seq,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        attn_backend=attn_backend,
        capture_aux_hidden_layers=capture_aux_hidden_layers,
        input_embeds=input_embeds,
    )


def idle_forward_batch(
    device: torch.device,
    *,
    req_to_token_pool: Any = None,
    token_to_kv_pool: Any = None,
    attn_backend: Any = None,
    capture_aux_hidden_layers: Optional[list[int]] = None,
) -> ForwardBatch:
    """An IDLE ForwardBatch: no requests, no tokens (DP attention runs it to keep collectives in step)."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        input_ids=empty,
        positions=empty.clone(),
        req_pool_indices=empty.clone(),
        seq_lens=empty.clone(),
        extend_prefix_lens=empty.clone(),
        extend_seq_lens=empty.clone(),
        out_cache_loc=empty.clone(),
        seq_lens_cpu=[],
        extend_prefix_lens_cpu=[],
        extend_seq_lens_cpu=[],
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        attn_backend=attn_backend,
        capture_aux_hidden_layers=capture_aux_hidden_layers,
    )
