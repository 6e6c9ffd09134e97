"""Page arithmetic of the KV slot pools, and the one admission formula (torch-free: the front end uses it).

A pool hands out slots in whole pages of ``page_size`` tokens. Every rounding of a token count to
pages is written here once.
"""

from __future__ import annotations


def ceil_div(n: int, d: int) -> int:
    """ceil(n / d) for integers (d > 0)."""
    return -(-n // d)


def round_up_to_page(n: int, page_size: int) -> int:
    """Smallest multiple of ``page_size`` that is >= n."""
    return ceil_div(n, page_size) * page_size


def floor_to_page(n: int, page_size: int) -> int:
    """Largest multiple of ``page_size`` that is <= n (0 for n < page_size)."""
    return max(0, n) // page_size * page_size


def pages_needed(prefix_len: int, extend_len: int, page_size: int) -> int:
    """Slots (whole fresh pages) the allocator takes to extend a request from ``prefix_len`` by ``extend_len``."""
    tail_room = (page_size - prefix_len % page_size) % page_size
    return round_up_to_page(max(0, extend_len - tail_room), page_size)


def request_kv_slots(
    prompt_len: int, max_new_tokens: int, page_size: int, decode_tokens_per_step: int = 1, prefill_only: bool = False
) -> int:
    """KV slots a request holds at its peak, in whole pages: whether it can ever fit the pool.

    Its last decode step holds K/V for ``prompt + max_new - 1`` tokens plus that step's block of
    ``decode_tokens_per_step`` slots (1, or B under speculation); a PD prefill node holds only the
    prompt. The tokenizer manager (before queueing) and the scheduler (at intake) both ask this.
    """
    if prefill_only:
        return round_up_to_page(prompt_len, page_size)
    return round_up_to_page(prompt_len + max_new_tokens - 1 + decode_tokens_per_step, page_size)


def max_new_tokens_that_fit(prompt_len: int, capacity: int, page_size: int, decode_tokens_per_step: int = 1) -> int:
    """The most new tokens a request of ``prompt_len`` can ask for with ``request_kv_slots`` <= ``capacity`` (may be < 1)."""
    return floor_to_page(capacity, page_size) - prompt_len + 1 - decode_tokens_per_step
