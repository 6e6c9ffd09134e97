"""Radix prefix cache: match / insert / split / evict / lock, page sizes 1 and 4, against a dict model."""

import random

import pytest
import torch

from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglite.srt.mem_cache.chunk_cache import ChunkCache
from sglite.srt.mem_cache.radix_cache import RadixCache

SUITE = "unit-cpu"
EST_TIME = 5


def _make(page_size: int, size: int = 256):
    alloc = PagedTokenToKVPoolAllocator(size, page_size, "cpu")
    return alloc, RadixCache(alloc, page_size)


def _insert_fresh(alloc, cache, key):
    """Allocate slots for ``key``, insert, free duplicates (what a finished request does)."""
    idx = alloc.alloc(len(key))
    assert idx is not None
    cache.cache_finished_req(key, idx, 0, cache.root)
    return idx


def test_match_insert_split_page1():
    alloc, cache = _make(1)
    assert cache.match_prefix([1, 2, 3]).length == 0
    idx = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], idx) == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.indices.tolist() == idx.tolist()
    # A partial match splits the edge; the upper node ends exactly at the match.
    m = cache.match_prefix([1, 2, 9])
    assert m.indices.tolist() == idx[:2].tolist()
    assert m.last_node.key == [1, 2]
    assert sorted(len(c.key) for c in m.last_node.children.values()) == [3]
    # Insert a branch: the shared part is reported as already cached.
    idx2 = alloc.alloc(4)
    assert cache.insert([1, 2, 7, 8], idx2) == 2
    assert cache.match_prefix([1, 2, 7, 8]).indices.tolist() == idx[:2].tolist() + idx2[2:].tolist()
    assert cache.evictable_size() == 7 and cache.protected_size() == 0
    cache.check_integrity()


def test_insert_rejects_length_mismatch():
    alloc, cache = _make(1)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_lock_protects_from_eviction_and_lru_order():
    alloc, cache = _make(1, size=64)
    start = alloc.available_size()
    a = _insert_fresh(alloc, cache, [1, 2, 3, 4])
    b = _insert_fresh(alloc, cache, [5, 6, 7])
    c = _insert_fresh(alloc, cache, [8, 9])
    cache.match_prefix([1, 2, 3, 4])  # refresh a: now b is least recently used
    m = cache.match_prefix([8, 9])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 7
    freed = cache.evict(1)
    assert freed == 3  # whole leaf b
    assert cache.match_prefix([5, 6, 7]).length == 0
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == a.tolist()
    # Evicting everything leaves the locked node.
    cache.evict(100)
    assert cache.match_prefix([8, 9]).indices.tolist() == c.tolist()
    assert cache.total_size() == 2
    cache.dec_lock_ref(m.last_node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)
    cache.evict(100)
    assert cache.total_size() == 0 and alloc.available_size() == start
    del b
    cache.check_integrity()


def test_evict_cascades_to_parent_after_children_go():
    alloc, cache = _make(1, size=64)
    _insert_fresh(alloc, cache, [1, 2, 3])
    _insert_fresh(alloc, cache, [1, 2, 4])  # splits: [1,2] -> {[3], [4]}
    assert cache.total_size() == 4
    assert cache.evict(4) == 4
    assert cache.total_size() == 0
    cache.check_integrity()


def test_lock_survives_split():
    alloc, cache = _make(1, size=64)
    _insert_fresh(alloc, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    _insert_fresh(alloc, cache, [1, 2, 9])  # splits the locked node
    cache.check_integrity()
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    cache.check_integrity()


def test_page_size_4_alignment():
    alloc, cache = _make(4, size=128)
    start = alloc.available_size()
    key = list(range(10, 20))  # 10 tokens: 2 whole pages + 2
    idx = alloc.alloc(10)
    cache.cache_finished_req(key, idx, 0, cache.root)
    assert cache.total_size() == 8  # partial last page freed
    assert alloc.available_size() + cache.total_size() == start
    assert cache.match_prefix(key).indices.tolist() == idx[:8].tolist()
    assert cache.match_prefix(key[:7]).length == 4  # match is page-aligned
    assert cache.match_prefix(key[:3]).length == 0
    # Diverging inside the second page: split only at a page boundary.
    m = cache.match_prefix(key[:6] + [99, 99])
    assert m.length == 4
    cache.check_integrity()
    # Children are filed by their first page: two keys sharing a first token do not collide.
    idx2 = alloc.alloc(8)
    cache.cache_finished_req([10, 11, 12, 77, 1, 2, 3, 4], idx2, 0, cache.root)
    assert cache.match_prefix([10, 11, 12, 77, 1, 2, 3, 4]).indices.tolist() == idx2.tolist()
    assert cache.match_prefix(key).indices.tolist() == idx[:8].tolist()
    cache.check_integrity()
    cache.evict(1000)
    assert alloc.available_size() == start


def test_finished_req_dedup_frees_duplicates():
    alloc, cache = _make(1, size=64)
    start = alloc.available_size()
    first = _insert_fresh(alloc, cache, [1, 2, 3, 4, 5])
    # A second request computed the same tokens itself (it started before the first finished).
    second = alloc.alloc(6)
    cache.cache_finished_req([1, 2, 3, 4, 5, 6], second, 0, cache.root)
    assert cache.total_size() == 6
    assert alloc.available_size() + cache.total_size() == start
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.indices.tolist() == first.tolist() + second[5:].tolist()
    # A third request that matched a locked prefix and extended it.
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    own = alloc.alloc(2)
    cache.cache_finished_req([1, 2, 3, 8, 9], torch.cat([m.indices, own]), 3, m.last_node)
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.total_size() == start
    cache.check_integrity()


def test_chunk_cache_frees_everything():
    alloc = PagedTokenToKVPoolAllocator(32, 1, "cpu")
    cache = ChunkCache(alloc, 1)
    start = alloc.available_size()
    idx = alloc.alloc(5)
    assert cache.match_prefix([1, 2, 3]).length == 0
    cache.cache_finished_req([1, 2, 3, 4, 5], idx, 0, None)
    assert alloc.available_size() == start and cache.total_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_workload_matches_dict_model(page_size):
    """Random inserts and matches agree with a dict of page-prefix -> page slots (first inserter wins)."""
    rng = random.Random(1234 + page_size)
    alloc, cache = _make(page_size, size=4096)
    start = alloc.available_size()
    p = page_size
    ref: dict[tuple, list[int]] = {}  # key[: (j+1)*p] -> slots of page j
    for _ in range(150):
        base = rng.choice([[], [1, 2, 3, 4, 5, 6], [1, 2, 7], [9] * 8])
        key = base[: rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(0, 10))]
        if rng.random() < 0.5:
            idx = alloc.alloc(len(key))
            cache.cache_finished_req(key, idx, 0, cache.root)
            for j in range(len(key) // p):
                ref.setdefault(tuple(key[: (j + 1) * p]), idx[j * p : (j + 1) * p].tolist())
        else:
            m = cache.match_prefix(key)
            pages = 0
            while (pages + 1) * p <= len(key) and tuple(key[: (pages + 1) * p]) in ref:
                pages += 1
            assert m.length == pages * p
            expect = [s for j in range(pages) for s in ref[tuple(key[: (j + 1) * p])]]
            assert m.indices.tolist() == expect
        assert alloc.available_size() + cache.total_size() == start
        cache.check_integrity()
    assert cache.total_size() == len(ref) * p
    cache.evict(10**6)
    assert alloc.available_size() == start


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_insert_lock_evict_against_slot_owner_map(page_size):
    """Interleaved finishes, locks and evictions. A map slot -> token prefix it caches (filled on
    insert, emptied when the cache frees a slot) must agree with every match; locked paths survive."""
    rng = random.Random(77 + page_size)
    alloc, cache = _make(page_size, size=512)
    start = alloc.available_size()
    owner: dict[int, tuple] = {}  # slot -> prefix of tokens ending at that slot
    real_free = alloc.free

    def tracking_free(idx):
        for s in idx.tolist():
            owner.pop(int(s), None)
        real_free(idx)

    alloc.free = tracking_free
    locks: list = []  # (node, key, indices) held
    for _ in range(400):
        op = rng.random()
        base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9], [4] * 12, []])
        key = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
        if op < 0.4:
            # A request: match + lock its prefix, compute the rest, finish.
            m = cache.match_prefix(key)
            cache.inc_lock_ref(m.last_node)
            own = alloc.alloc(len(key) - m.length)
            if own is None:
                cache.evict(len(key))
                own = alloc.alloc(len(key) - m.length)
            if own is None:
                cache.dec_lock_ref(m.last_node)
                continue
            idx = torch.cat([m.indices, own])
            for i in range(m.length, len(key)):
                owner[int(idx[i])] = tuple(key[: i + 1])
            cache.cache_finished_req(key, idx, m.length, m.last_node)
        elif op < 0.55:
            m = cache.match_prefix(key)
            cache.inc_lock_ref(m.last_node)
            locks.append((m.last_node, key[: m.length], m.indices))
        elif op < 0.7 and locks:
            node, _, _ = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(node)
        elif op < 0.85:
            cache.evict(rng.randint(1, 40))
        else:
            m = cache.match_prefix(key)
            for j, s in enumerate(m.indices.tolist()):
                assert owner[s] == tuple(key[: j + 1])
        for _, k, idx in locks:  # locked prefixes are never evicted
            for j, s in enumerate(idx.tolist()):
                assert owner.get(s) == tuple(k[: j + 1])
        assert set(owner) == set(cache.all_slots().tolist())
        assert alloc.available_size() + cache.total_size() == start
        cache.check_integrity()
    for node, _, _ in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.evict(10**6)
    assert alloc.available_size() == start and not owner
