"""Radix prefix cache: a compressed trie from token ids to KV slot indices.

One slot id space serves the target and the draft KV pools, so a hit reuses both without recompute.
Invariants (``check_integrity`` verifies them):
- every non-root node has a non-empty key whose length is a multiple of ``page_size`` and equals
  the length of its ``value`` (slot indices); a child is filed under its key's first page;
- ``lock_ref`` of a node = number of outstanding ``inc_lock_ref`` calls on it or a descendant, so a
  parent's lock_ref >= the sum of its children's;
- ``evictable_size`` / ``protected_size`` = total key length of nodes with lock_ref == 0 / > 0;
- no slot appears twice in the tree. Only unlocked leaves are evicted (least recently used first).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Hashable, Optional, Protocol, Sequence

import torch

from sglite.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, empty_indices
from sglite.srt.mem_cache.paging import floor_to_page


class SlotFreer(Protocol):
    """What the cache needs from the slot allocator."""

    def free(self, free_index: torch.Tensor) -> None:
        """Return slots to the free list."""


class TreeNode:
    """One edge of the trie: ``key`` tokens stored in ``value`` slots."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: Optional["TreeNode"]) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heapq tie-break
        return self.last_access < other.last_access


class RadixCache(BasePrefixCache):
    """Radix tree over token ids with LRU eviction of unlocked leaves; page-aligned when page_size > 1."""

    def __init__(self, allocator: SlotFreer, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)  # logical LRU clock: deterministic, strictly increasing
        self.reset()

    # ------------------------------------------------------------------ helpers
    def reset(self) -> None:
        """Drop every entry without freeing (the caller clears the allocator too)."""
        self.root = TreeNode([], empty_indices(), None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    def _child_key(self, key: Sequence[int]) -> Hashable:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _common_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return floor_to_page(n, self.page_size)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; return the new upper node (it inherits child's lock_ref)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        assert child.parent is not None
        child.parent.children[self._child_key(upper.key)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ------------------------------------------------------------------ public API
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; refreshes LRU time along the path."""
        key = list(key[: self.page_aligned(len(key))])
        now = next(self._clock)
        node = self.root
        node.last_access = now
        parts: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._common_len(child.key, key)
            if n < len(child.key):
                if n == 0:
                    break
                child = self._split(child, n)
                parts.append(child.value)
                node = child
                break
            parts.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(parts) if parts else empty_indices()
        return MatchResult(indices=indices, last_node=node)

    def insert(self, key: Sequence[int], indices: torch.Tensor) -> int:
        """Insert ``key`` → ``indices`` (truncated to whole pages); return the already-cached prefix length."""
        if len(key) != int(indices.numel()):
            raise ValueError(f"insert: key has {len(key)} tokens but {int(indices.numel())} slots")
        n_total = self.page_aligned(len(key))
        key = list(key[:n_total])
        value = indices[:n_total]
        now = next(self._clock)
        node = self.root
        matched = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._common_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            matched += n
            node = child
            key = key[n:]
            value = value[n:]
        if key:
            leaf = TreeNode(key, value.clone(), node)
            leaf.last_access = now
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return matched

    def cache_finished_req(
        self, token_ids: Sequence[int], indices: torch.Tensor, prefix_len: int, last_node: Any
    ) -> None:
        """Insert the request's computed tokens; free duplicates and the partial last page; unlock."""
        if len(token_ids) != int(indices.numel()):
            raise ValueError(f"cache_finished_req: {len(token_ids)} tokens but {int(indices.numel())} slots")
        aligned = self.page_aligned(len(token_ids))
        already = self.insert(token_ids[:aligned], indices[:aligned])
        # Tokens [prefix_len, already) were computed by this request but the tree got them from someone
        # else meanwhile: free our copies. Tokens past the last whole page cannot be cached: free them.
        if already > prefix_len:
            self.allocator.free(indices[prefix_len:already])
        if aligned < len(token_ids):
            self.allocator.free(indices[aligned:])
        self.dec_lock_ref(last_node)

    def inc_lock_ref(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked radix node (unbalanced lock)")
            if node.lock_ref == 1:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` slots are freed."""
        heap = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Slots held by locked nodes."""
        return self._protected

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for leak checks)."""
        vals = [n.value for n in self._iter_nodes() if n is not self.root]
        return torch.cat(vals) if vals else empty_indices()

    # ------------------------------------------------------------------ integrity
    def _iter_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Assert the invariants listed in the module docstring."""
        evictable = protected = 0
        for node in self._iter_nodes():
            child_locks = 0
            for ck, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                assert len(child.key) > 0, "empty key below the root"
                assert len(child.key) % self.page_size == 0, "key not page-aligned"
                assert len(child.key) == int(child.value.numel()), "key/value length mismatch"
                assert self._child_key(child.key) == ck, "child filed under the wrong first page"
                assert child.lock_ref >= 0, "negative lock_ref"
                child_locks += child.lock_ref
            if node is not self.root:
                assert node.lock_ref >= child_locks, "lock_ref smaller than its children's sum"
                if node.lock_ref == 0:
                    evictable += len(node.key)
                else:
                    protected += len(node.key)
        assert evictable == self._evictable, f"evictable_size {self._evictable} != tree {evictable}"
        assert protected == self._protected, f"protected_size {self._protected} != tree {protected}"
        slots = self.all_slots()
        assert torch.unique(slots).numel() == slots.numel(), "a slot appears twice in the tree"

    def pretty(self) -> str:
        """Text dump of the tree (debugging)."""
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{child.key} lock={child.lock_ref}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)
