"""Admission budget and queue order: page arithmetic against the real allocator, chunking, lpm/fcfs."""

import pytest

from sglite.srt.managers.schedule_batch import Req
from sglite.srt.managers.schedule_policy import AddResult, PrefillBudget, SchedulePolicy, mixed_prefill_share
from sglite.srt.mem_cache.paging import pages_needed
from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglite.srt.mem_cache.radix_cache import RadixCache
from sglite.srt.sampling.sampling_params import SamplingParams

SUITE = "unit-cpu"
EST_TIME = 3


def _req(rid, n, max_new=10):
    return Req(rid=rid, origin_input_ids=list(range(1, n + 1)), sampling_params=SamplingParams(max_new_tokens=max_new))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("prefix", [0, 1, 3, 4, 5, 8])
@pytest.mark.parametrize("extend", [1, 2, 3, 4, 7, 9])
def test_pages_needed_equals_what_the_allocator_takes(page_size, prefix, extend):
    alloc = PagedTokenToKVPoolAllocator(64, page_size, "cpu")
    last_loc = 0
    if prefix:
        head = alloc.alloc(prefix)
        last_loc = int(head[-1])
    before = alloc.available_size()
    loc = alloc.alloc_extend([prefix], [prefix + extend], [last_loc])
    assert loc is not None and loc.numel() == extend
    assert before - alloc.available_size() == pages_needed(prefix, extend, page_size)


def test_budget_admits_reserves_and_chunks():
    b = PrefillBudget(rem_kv_tokens=100, rem_chunk_tokens=16, page_size=4, new_token_ratio=0.5)
    assert b.offer(_req("a", 10, max_new=20), 0) == (AddResult.ADDED, 10)
    assert b.rem_kv_tokens == 100 - 12 - 10  # 3 pages + half of 20 future tokens
    assert b.rem_chunk_tokens == 6
    # 9 tokens do not fit the 6-token chunk budget: a page-aligned chunk of 4 is taken, no reserve yet.
    assert b.offer(_req("b", 9), 0) == (AddResult.CHUNKED, 4)
    assert b.rem_chunk_tokens == 2
    assert b.offer(_req("c", 9), 0) == (AddResult.NO_CHUNK_BUDGET, 0)


def test_budget_no_tokens():
    b = PrefillBudget(rem_kv_tokens=10, rem_chunk_tokens=None, page_size=1, new_token_ratio=1.0)
    assert b.offer(_req("a", 5, max_new=6), 0) == (AddResult.NO_TOKENS, 0)
    assert b.rem_kv_tokens == 10
    assert b.offer(_req("b", 5, max_new=5), 0) == (AddResult.ADDED, 5)
    with pytest.raises(ValueError):
        b.offer(_req("c", 3), 3)


def test_lpm_orders_by_cached_prefix_fcfs_keeps_arrival():
    alloc = PagedTokenToKVPoolAllocator(64, 1, "cpu")
    cache = RadixCache(alloc, 1)
    key = [1, 2, 3, 4, 5, 6]
    cache.insert(key, alloc.alloc(6))
    cold, warm, hot = _req("cold", 3), _req("warm", 3), _req("hot", 7)
    cold.origin_input_ids = [9, 9, 9]
    warm.origin_input_ids = [1, 2, 9]
    waiting = [cold, warm, hot]
    assert [r.rid for r in SchedulePolicy("lpm", cache, True).order(waiting)] == ["hot", "warm", "cold"]
    assert [r.rid for r in SchedulePolicy("fcfs", cache, True).order(waiting)] == ["cold", "warm", "hot"]
    assert [r.rid for r in SchedulePolicy("lpm", cache, False).order(waiting)] == ["cold", "warm", "hot"]


@pytest.mark.parametrize(
    "waiting,decoding,cap,share",
    [
        (0, 5, 2048, 64),  # nothing queued: the base share
        (2, 10, 2048, 64),  # a trickle: fewer waiting than decoding keeps the base ITL bound
        (9, 10, 2048, 64),
        (10, 10, 2048, 64),  # one waiting per decoding request: still 1x
        (20, 10, 2048, 128),  # a burst: base times waiting-per-decoding (floored)
        (30, 2, 2048, 960),
        (30, 2, 500, 500),  # never past the forward's chunk budget
        (30, 0, None, 1920),  # chunking off: unbounded; no decoding request counts as one
        (3, 1, 2048, 64),  # a short queue (Poisson arrivals) never grows the share
        (4, 1, 2048, 256),  # MIXED_SHARE_MIN_WAITING waiting: it grows
    ],
)
def test_mixed_prefill_share_scales_with_waiting_per_decoding(waiting, decoding, cap, share):
    assert mixed_prefill_share(64, cap, waiting, decoding) == share
