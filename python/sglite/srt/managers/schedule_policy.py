"""Which waiting requests a prefill batch admits: queue order (lpm / fcfs) and the admission budget.

Admission is bounded by (a) free KV slots plus what the prefix cache could evict, minus a reserve for
the future decode tokens of running and admitted requests (``new_token_ratio`` of their remaining
``max_new_tokens``, as SGLang estimates it), (b) ``max_running_requests`` and free req_to_token rows,
and (c) the chunked-prefill token budget per forward. A request that does not fit the chunk budget
is cut into a page-aligned chunk and becomes the batch's (single) chunked request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from sglite.srt.managers.schedule_batch import Req
from sglite.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglite.srt.mem_cache.paging import floor_to_page, pages_needed

# Above this many waiting requests, lpm's prefix matching costs more than it saves: use fcfs.
LPM_MAX_QUEUE = 128
# Cap on the decode tokens one request is assumed to still need when reserving KV for it.
CLIP_MAX_NEW_TOKENS = 4096


class Policy(str, enum.Enum):
    """Waiting-queue order."""

    LPM = "lpm"  # longest cached prefix first (maximises radix reuse)
    FCFS = "fcfs"  # arrival order


def prefix_key(req: Req) -> list[int]:
    """The tokens a request may take from the prefix cache: all but the newest (its logits are needed).

    Prompt logprobs from position s need the logits at s - 1, so such a request takes at most s - 1 tokens.
    """
    start = req.input_logprob_start
    return req.all_token_ids[: -1 if start is None else max(start - 1, 0)]


class SchedulePolicy:
    """Orders the waiting queue."""

    def __init__(self, policy: str, tree_cache: BasePrefixCache, cache_enabled: bool) -> None:
        self.policy = Policy(policy)
        self.tree_cache = tree_cache
        self.cache_enabled = cache_enabled

    def order(self, waiting: list[Req]) -> list[Req]:
        """Waiting requests in the order they should be tried (stable: ties keep arrival order)."""
        if self.policy == Policy.FCFS or not self.cache_enabled or len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        match_len = {id(r): self.tree_cache.match_prefix(prefix_key(r)).length for r in waiting}
        return sorted(waiting, key=lambda r: -match_len[id(r)])


# Fewer waiting requests than this never grow the mixed share: under Poisson arrivals a queue of 2-3 behind
# one decoding request is common, and doubling the share there pushed ITL p99/p50 past 3x on a loaded box
# (docs/benchmarks.md, "Mixed steps"); a burst is a longer queue.
MIXED_SHARE_MIN_WAITING = 4


def mixed_prefill_share(base: int, cap: Optional[int], num_waiting: int, num_decoding: int) -> Optional[int]:
    """Prefill tokens of one mixed step: ``base`` times waiting-per-decoding request (at least 1x), capped at ``cap``.

    A step's prefill tokens stall each decoding request once and save each waiting one a step of TTFT, so
    the share grows with the ratio of the two: a trickle (a few waiting, many decoding) keeps the base
    share's ITL bound, a burst (a queue of at least ``MIXED_SHARE_MIN_WAITING``, few decoding) is admitted
    in a few steps. ``cap`` None = unbounded.
    """
    growth = num_waiting // max(1, num_decoding) if num_waiting >= MIXED_SHARE_MIN_WAITING else 1
    share = base * max(1, growth)
    return share if cap is None else min(share, cap)


def decode_reserve(req: Req, new_token_ratio: float) -> int:
    """KV slots to keep free for ``req``'s future decode tokens: a fraction of its remaining budget."""
    remaining = max(0, req.sampling_params.max_new_tokens - len(req.output_ids))
    return int(min(remaining, CLIP_MAX_NEW_TOKENS) * new_token_ratio)


class AddResult(enum.Enum):
    """Outcome of offering one request to the budget."""

    ADDED = "added"  # the whole remaining prompt fits
    CHUNKED = "chunked"  # a chunk fits; the request continues in a later prefill
    NO_TOKENS = "no_tokens"  # KV budget exhausted: stop admitting
    NO_CHUNK_BUDGET = "no_chunk_budget"  # the forward's token budget is spent: stop admitting


@dataclass
class PrefillBudget:
    """Remaining KV tokens and per-forward prefill tokens while one prefill batch is assembled."""

    rem_kv_tokens: int
    rem_chunk_tokens: Optional[int]  # None = chunked prefill disabled
    page_size: int
    new_token_ratio: float

    def reserve_for(self, req: Req) -> int:
        """Estimated future decode tokens of ``req`` to keep free."""
        return decode_reserve(req, self.new_token_ratio)

    def offer(self, req: Req, prefix_len: int) -> tuple[AddResult, int]:
        """Try to admit ``req``'s tokens after ``prefix_len``; return (result, tokens to prefill now)."""
        extend = req.seq_len - prefix_len
        if extend <= 0:
            raise ValueError(f"request {req.rid} has nothing to prefill (prefix {prefix_len}, seq {req.seq_len})")
        take = extend
        if self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens:
            take = floor_to_page(self.rem_chunk_tokens, self.page_size)
            if take <= 0:
                return AddResult.NO_CHUNK_BUDGET, 0
        slots = pages_needed(prefix_len, take, self.page_size)
        reserve = self.reserve_for(req) if take == extend else 0
        if slots + reserve > self.rem_kv_tokens:
            return AddResult.NO_TOKENS, 0
        self.rem_kv_tokens -= slots + reserve
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= take
        return (AddResult.ADDED if take == extend else AddResult.CHUNKED), take
