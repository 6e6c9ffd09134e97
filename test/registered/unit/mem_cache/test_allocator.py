"""PagedTokenToKVPoolAllocator: slot range, whole pages, tail filling, free, and random op sequences."""

SUITE = "unit-cpu"
EST_TIME = 8

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sglite.srt.mem_cache.allocator as allocator_module
from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator


def test_slots_in_range_and_padding_page_reserved():
    a = PagedTokenToKVPoolAllocator(size=64, page_size=16, device="cpu")
    assert a.available_size() == 64
    got = a.alloc(64)
    assert got is not None and got.numel() == 64
    assert sorted(got.tolist()) == list(range(16, 80))  # [page_size, size + page_size)
    assert a.alloc(1) is None
    assert a.available_size() == 0


def test_alloc_takes_whole_pages_and_free_returns_them():
    a = PagedTokenToKVPoolAllocator(size=64, page_size=16, device="cpu")
    x = a.alloc(5)
    assert x.numel() == 5
    assert len(set((x // 16).tolist())) == 1  # one page
    assert x.tolist() == list(range(int(x[0]), int(x[0]) + 5))
    assert a.available_size() == 48
    a.free(x)
    assert a.available_size() == 64
    with pytest.raises(ValueError, match="double free"):
        a.free(x)
    with pytest.raises(ValueError):
        a.free(torch.tensor([3]))  # padding page


def test_alloc_when_short_allocates_nothing():
    a = PagedTokenToKVPoolAllocator(size=32, page_size=16, device="cpu")
    assert a.alloc(17) is not None
    assert a.alloc(1) is None
    assert a.alloc_extend([0], [5], [0]) is None
    assert a.available_size() == 0


def test_alloc_extend_fills_the_tail_of_the_last_page_first():
    a = PagedTokenToKVPoolAllocator(size=128, page_size=4, device="cpu")
    first = a.alloc_extend([0, 0], [6, 3], [-1, -1])
    assert first.numel() == 9
    r0, r1 = first[:6], first[6:]
    # request 0: tokens 0..5 on two pages; token 5 sits at offset 1 of its page
    assert int(r0[4]) % 4 == 0 and int(r0[5]) == int(r0[4]) + 1
    avail = a.available_size()
    # extend request 0 by 3 tokens (positions 6,7,8): 6,7 fill its page, 8 needs a new page
    nxt = a.alloc_extend([6, 3], [9, 4], [int(r0[5]), int(r1[2])])
    assert nxt[:2].tolist() == [int(r0[5]) + 1, int(r0[5]) + 2]
    assert int(nxt[2]) % 4 == 0
    # request 1 extends 3->4: fills the tail of its page, no new page
    assert int(nxt[3]) == int(r1[2]) + 1
    assert a.available_size() == avail - 4  # exactly one new page
    dec = a.alloc_decode([10, 5], [int(nxt[2]), int(nxt[3])])
    # request 0 token 9 fits its page; request 1 token 4 starts a fresh page (token 3 ended one)
    assert int(nxt[3]) % 4 == 3
    assert int(dec[0]) == int(nxt[2]) + 1
    assert int(dec[1]) % 4 == 0 and int(dec[1]) // 4 != int(nxt[3]) // 4


def test_size_must_be_page_multiple():
    with pytest.raises(ValueError):
        PagedTokenToKVPoolAllocator(size=30, page_size=16, device="cpu")


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), min_size=1, max_size=30),
)
def test_random_alloc_free_never_hands_out_a_slot_twice(page_size, ops):
    size = 64 * page_size
    a = PagedTokenToKVPoolAllocator(size=size, page_size=page_size, device="cpu")
    live: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            before = a.available_size()
            got = a.alloc(n)
            if got is None:
                assert -(-n // page_size) * page_size > before
                assert a.available_size() == before
                continue
            assert got.numel() == n
            assert a.available_size() == before - (-(-n // page_size)) * page_size
            live.append(got)
        else:
            a.free(live.pop(n % len(live)))
        held = torch.cat(live) if live else torch.empty(0, dtype=torch.int64)
        assert held.unique().numel() == held.numel()
        if held.numel():
            assert int(held.min()) >= page_size and int(held.max()) < size + page_size
        held_pages = held.div(page_size, rounding_mode="floor").unique().numel()
        assert a.available_size() == size - held_pages * page_size


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("small_path_limit", [0, 10_000], ids=["tensor_path", "list_path"])
def test_alloc_extend_slots_follow_page_tails_then_fresh_pages(page_size, small_path_limit, monkeypatch):
    """Ragged batch (tails, zero-length requests, multi-page fresh runs): each request's slots are its
    page tail ``last_loc+1 ..`` then whole fresh pages taken in request order."""
    monkeypatch.setattr(allocator_module, "_SMALL_EXTEND_SLOTS", small_path_limit)
    gen = torch.Generator().manual_seed(page_size)
    alloc = PagedTokenToKVPoolAllocator(page_size * 200, page_size, "cpu")
    alloc.alloc(7 * page_size)  # the next free pages are not page 1
    prefix = torch.randint(0, 30, (12,), generator=gen).tolist()
    new = torch.randint(0, 20, (12,), generator=gen).tolist()
    last = [(150 + i) * page_size + (p - 1) % page_size if p else 0 for i, p in enumerate(prefix)]
    free_before = alloc._free_pages.clone()
    out = alloc.alloc_extend(prefix, [p + n for p, n in zip(prefix, new)], last).tolist()
    pos, next_page = 0, 0
    for p, n, loc in zip(prefix, new, last):
        mine = out[pos : pos + n]
        pos += n
        tail = min(n, page_size - p % page_size) if p and p % page_size else 0
        assert mine[:tail] == list(range(loc + 1, loc + 1 + tail))
        for j, slot in enumerate(mine[tail:]):
            page = int(free_before[next_page + j // page_size])
            assert slot == page * page_size + j % page_size
        next_page += -(-(n - tail) // page_size)
    assert pos == len(out)
