"""Paged token-slot allocator shared by the target and draft KV pools (slot i is one token in both).

Slots live in ``[page_size, size + page_size)``; page 0 (slots ``[0, page_size)``) is a reserved padding
page so slot 0 can be the dummy write target of padded rows. Free space is tracked in whole pages: a
page is owned by one request, and freeing any slot of a page frees the page.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from sglite.srt.mem_cache.paging import ceil_div

IntSeq = Union[Sequence[int], torch.Tensor]


def _to_list(x: IntSeq) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


class PagedTokenToKVPoolAllocator:
    """Hands out KV slot indices in whole pages; ``page_size`` 1 is plain token allocation."""

    def __init__(self, size: int, page_size: int, device: Union[str, torch.device]) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size != 0:
            raise ValueError(f"allocator size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        """Return every page to the free list (pages 1..num_pages; page 0 is padding)."""
        # Bookkeeping stays on CPU: sizes are needed in Python anyway, and meta tensors hold no values.
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        # Freed pages wait here and are merged only when an allocation needs them: a free is then
        # O(pages freed), not a copy of the whole free list.
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        self._page_is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._page_is_free[0] = False

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        """Free slots (whole free pages × page_size)."""
        return (int(self._free_pages.numel()) + self._num_released) * self.page_size

    def _out(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.device.type == "cpu" else idx.to(self.device)

    def _take_pages(self, k: int) -> Optional[torch.Tensor]:
        if k > self._free_pages.numel() and self._released:
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released, self._num_released = [], 0
        if k > self._free_pages.numel():
            return None
        pages = self._free_pages[:k]
        self._free_pages = self._free_pages[k:]
        self._page_is_free[pages] = False
        return pages

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` fresh slots from ``ceil(need/page)`` whole pages (page-contiguous); None when short."""
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size == 0:
            return self._out(torch.empty(0, dtype=torch.int64))
        num_pages = ceil_div(need_size, self.page_size)
        pages = self._take_pages(num_pages)
        if pages is None:
            return None
        offs = torch.arange(self.page_size, dtype=torch.int64)
        slots = (pages[:, None] * self.page_size + offs[None, :]).reshape(-1)[:need_size]
        return self._out(slots)

    def alloc_extend(
        self, prefix_lens: IntSeq, seq_lens: IntSeq, last_locs: IntSeq
    ) -> Optional[torch.Tensor]:
        """Slots for tokens ``[prefix_len, seq_len)`` of each request, concatenated in request order.

        Each request first fills the rest of the page holding its last token (``last_locs[i]``, the slot
        of token ``prefix_len-1``; ignored when ``prefix_len`` is 0), then takes fresh pages. Returns
        None (and allocates nothing) when there are not enough free pages.
        """
        prefix, seq, last = _to_list(prefix_lens), _to_list(seq_lens), _to_list(last_locs)
        if not (len(prefix) == len(seq) == len(last)):
            raise ValueError("prefix_lens, seq_lens and last_locs must have the same length")
        p = self.page_size
        plans: list[tuple[int, int, int]] = []  # (first tail slot, tail count, fresh count)
        fresh_pages = 0
        for pre, sl, loc in zip(prefix, seq, last):
            n = sl - pre
            if n < 0:
                raise ValueError(f"seq_len {sl} < prefix_len {pre}")
            tail = 0
            if pre > 0 and pre % p != 0:
                tail = min(n, p - pre % p)
                if loc < p or loc % p != (pre - 1) % p:
                    raise ValueError(
                        f"last_loc {loc} does not hold token {pre - 1} of its page (page_size {p})"
                    )
            fresh = n - tail
            plans.append((loc + 1, tail, fresh))
            fresh_pages += ceil_div(fresh, p)
        pages = self._take_pages(fresh_pages)
        if pages is None:
            return None
        return self._out(_extend_slots(plans, pages, p))

    def alloc_decode(self, seq_lens: IntSeq, last_locs: IntSeq) -> Optional[torch.Tensor]:
        """One slot per request for the token at position ``seq_len - 1`` (``seq_lens`` after the step)."""
        seq = _to_list(seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_locs)

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages holding these slots; freeing a free page or the padding page is an error."""
        if free_index is None or free_index.numel() == 0:
            return
        pages = torch.unique(free_index.detach().to("cpu", torch.int64) // self.page_size)
        if int(pages.min()) < 1 or int(pages.max()) > self.num_pages:
            raise ValueError(f"free(): slot outside [{self.page_size}, {self.size + self.page_size})")
        if bool(self._page_is_free[pages].any()):
            raise ValueError("free(): a page being freed is already free (double free)")
        self._page_is_free[pages] = True
        self._released.append(pages)
        self._num_released += int(pages.numel())


class SWATokenToKVPoolAllocator:
    """Allocates a full-pool slot and a sliding-pool slot per token and records full→swa in the pool's mapping.

    Callers only ever see full-pool slots. ``free_swa`` releases the sliding slots of tokens that left
    the window (pass whole pages: freeing is per page) while their full slots stay allocated.
    """

    def __init__(self, full_size: int, swa_size: int, page_size: int, device, full_to_swa_index_mapping: torch.Tensor) -> None:
        if full_to_swa_index_mapping.numel() != full_size + page_size:
            raise ValueError("full_to_swa_index_mapping must have full_size + page_size entries")
        self.full_attn_allocator = PagedTokenToKVPoolAllocator(full_size, page_size, device)
        self.swa_attn_allocator = PagedTokenToKVPoolAllocator(swa_size, page_size, device)
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self.size = full_size
        self.swa_size = swa_size
        self.page_size = page_size
        self.device = torch.device(device)

    def available_size(self) -> int:
        """Tokens that can be allocated now (limited by the smaller free space)."""
        return min(self.full_attn_allocator.available_size(), self.swa_attn_allocator.available_size())

    def full_available_size(self) -> int:
        """Free full-pool slots."""
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        """Free sliding-pool slots."""
        return self.swa_attn_allocator.available_size()

    def _pair(self, full: Optional[torch.Tensor], swa: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if full is None or swa is None:
            if full is not None:
                self.full_attn_allocator.free(full)
            if swa is not None:
                self.swa_attn_allocator.free(swa)
            return None
        self.full_to_swa_index_mapping[full.to(self.full_to_swa_index_mapping.device)] = swa.to(
            self.full_to_swa_index_mapping.device
        )
        return full

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Full-pool slots for ``need_size`` tokens (with their sliding slots mapped); None when short."""
        return self._pair(self.full_attn_allocator.alloc(need_size), self.swa_attn_allocator.alloc(need_size))

    def alloc_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq, last_locs: IntSeq) -> Optional[torch.Tensor]:
        """Page-aware extend in both pools (see ``PagedTokenToKVPoolAllocator.alloc_extend``)."""
        last = torch.as_tensor(_to_list(last_locs), dtype=torch.int64)
        mapping = self.full_to_swa_index_mapping
        mapped = mapping[last.clamp(min=0).to(mapping.device)].to("cpu")  # gather first: copy n, not the table
        swa_last = torch.where(last >= self.page_size, mapped, last)
        full = self.full_attn_allocator.alloc_extend(prefix_lens, seq_lens, last)
        if full is None:
            return None
        return self._pair(full, self.swa_attn_allocator.alloc_extend(prefix_lens, seq_lens, swa_last))

    def alloc_decode(self, seq_lens: IntSeq, last_locs: IntSeq) -> Optional[torch.Tensor]:
        """One slot per request for the token at ``seq_len - 1``."""
        seq = _to_list(seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_locs)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Free only the sliding slots of these full slots (tokens outside the window)."""
        if free_index is None or free_index.numel() == 0:
            return
        idx = free_index.to(self.full_to_swa_index_mapping.device).long()
        swa = self.full_to_swa_index_mapping[idx]
        swa = swa[swa > 0]
        if swa.numel():
            self.swa_attn_allocator.free(swa)
        self.full_to_swa_index_mapping[idx] = 0

    def free(self, free_index: torch.Tensor) -> None:
        """Free full slots and whatever sliding slots they still hold."""
        if free_index is None or free_index.numel() == 0:
            return
        self.free_swa(free_index)
        self.full_attn_allocator.free(free_index)


# Below this many new slots (decode, small extends) plain Python lists beat a dozen tensor ops.
_SMALL_EXTEND_SLOTS = 512


def _extend_slots_small(plans: list[tuple[int, int, int]], pages: list[int], page_size: int) -> torch.Tensor:
    """``_extend_slots`` for a few slots, built as one Python list."""
    out: list[int] = []
    cursor = 0
    for start, tail, fresh in plans:
        out.extend(range(start, start + tail))
        k = ceil_div(fresh, page_size)
        for j, page in enumerate(pages[cursor : cursor + k]):
            out.extend(range(page * page_size, page * page_size + min(page_size, fresh - j * page_size)))
        cursor += k
    return torch.tensor(out, dtype=torch.int64)


def _extend_slots(plans: list[tuple[int, int, int]], pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each request's tail slots then its fresh pages' first slots, concatenated, in a few tensor ops.

    ``plans[i]`` is (first tail slot, tail count, fresh count); request i owns the next
    ``ceil(fresh / page_size)`` of ``pages`` in order. Replaces a per-request Python loop of small tensors.
    """
    if sum(t + f for _, t, f in plans) <= _SMALL_EXTEND_SLOTS:
        return _extend_slots_small(plans, pages.tolist(), page_size)
    plan = torch.tensor(plans, dtype=torch.int64).reshape(-1, 3)
    start, tail, fresh = plan[:, 0], plan[:, 1], plan[:, 2]
    counts = tail + fresh
    total = int(counts.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(plans)), counts, output_size=total)
    j = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[req]  # index inside the request's span
    in_tail = j < tail[req]
    slots = start[req] + j
    if pages.numel():
        grid = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        pages_per_req = ceil_div(fresh, page_size)
        first_page = torch.cumsum(pages_per_req, 0) - pages_per_req
        fresh_pos = (first_page[req] * page_size + j - tail[req]).clamp(0, grid.numel() - 1)
        slots = torch.where(in_tail, slots, grid[fresh_pos])
    return slots
