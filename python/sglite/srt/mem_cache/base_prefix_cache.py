"""The prefix-cache interface the scheduler talks to (radix cache, or the no-cache variant).

Slot ownership, which every implementation keeps:
- A slot is owned by exactly one of: the allocator's free list, the cache (a tree node), or one
  running request (the tokens it computed beyond its matched prefix).
- ``match_prefix`` hands out slots the cache still owns; the caller must ``inc_lock_ref`` the
  returned node while it reads them and ``dec_lock_ref`` it afterwards. Locked nodes are never evicted.
- ``cache_finished_req`` takes over a finished request's slots: what the cache keeps it owns, the rest
  (duplicates of tokens it already holds, a partial last page) goes back to the allocator.
So ``allocator.available_size() + cache.total_size() + slots held by running requests`` is constant.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from sglite.srt.mem_cache.paging import floor_to_page


@dataclass
class MatchResult:
    """The longest cached prefix of a key: its KV slots and the tree node that ends it."""

    indices: torch.Tensor  # int64 [n] KV slots of the matched tokens (n is page-aligned)
    last_node: Any  # handle for inc_lock_ref / dec_lock_ref (None when nothing can be locked)

    @property
    def length(self) -> int:
        """Number of matched tokens."""
        return int(self.indices.numel())


class BasePrefixCache(abc.ABC):
    """Maps token-id sequences to KV slot indices shared by the target and draft pools."""

    page_size: int

    @abc.abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; refreshes its LRU time. Does not lock."""

    @abc.abstractmethod
    def insert(self, key: Sequence[int], indices: torch.Tensor) -> int:
        """Insert ``key`` → ``indices`` (page-aligned length); return how many leading tokens were
        already cached. The caller still owns (and must free) its slots for those leading tokens."""

    @abc.abstractmethod
    def cache_finished_req(
        self, token_ids: Sequence[int], indices: torch.Tensor, prefix_len: int, last_node: Any
    ) -> None:
        """Take over a finished request's KV: ``indices[:prefix_len]`` came from ``match_prefix``
        (locked at ``last_node``), ``indices[prefix_len:]`` are the request's own slots. Keeps what it
        can, frees the rest to the allocator, and unlocks ``last_node``."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots of unlocked entries (LRU first) if possible; return freed."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Slots held by unlocked entries."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Slots held by locked entries."""

    def total_size(self) -> int:
        """All slots the cache holds."""
        return self.evictable_size() + self.protected_size()

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every entry without freeing (the caller clears the allocator too)."""

    def check_integrity(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent (for tests)."""

    def page_aligned(self, n: int) -> int:
        """``n`` rounded down to a whole number of pages."""
        return floor_to_page(n, self.page_size)


def empty_indices(device: Optional[torch.device] = None) -> torch.Tensor:
    """An empty int64 slot-index tensor."""
    return torch.empty(0, dtype=torch.int64, device=device)
