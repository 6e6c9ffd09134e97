"""The no-cache variant behind ``--disable-radix-cache``: nothing is shared, finished KV is freed."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sglite.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, empty_indices
from sglite.srt.mem_cache.radix_cache import SlotFreer


class ChunkCache(BasePrefixCache):
    """Never matches, never holds slots; a finished request's slots all go back to the allocator."""

    def __init__(self, allocator: SlotFreer, page_size: int = 1) -> None:
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Always an empty match."""
        return MatchResult(indices=empty_indices(), last_node=None)

    def insert(self, key: Sequence[int], indices: torch.Tensor) -> int:
        """Keeps nothing; reports no cached prefix (the caller keeps ownership of ``indices``)."""
        return 0

    def cache_finished_req(
        self, token_ids: Sequence[int], indices: torch.Tensor, prefix_len: int, last_node: Any
    ) -> None:
        """Free every slot of the request (its prefix is always empty here)."""
        if prefix_len != 0:
            raise ValueError("ChunkCache never matches, so a request's prefix_len must be 0")
        self.allocator.free(indices)

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict."""
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        """No nodes to lock."""

    def dec_lock_ref(self, node: Any) -> None:
        """No nodes to unlock."""

    def evictable_size(self) -> int:
        """Always 0."""
        return 0

    def protected_size(self) -> int:
        """Always 0."""
        return 0

    def reset(self) -> None:
        """Nothing to drop."""
