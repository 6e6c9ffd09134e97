"""The scheduler's KV slots: allocate a batch's slots (evicting the prefix cache when short) and build the
batch over them, release finished requests into the prefix cache, retract a request, flush the cache.

Slot accounting invariant: ``allocator.available_size() + tree_cache.total_size()`` plus the slots
held by requests in flight equals the allocator's size; with nothing in flight it is the size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from sglite.srt.managers.io_struct import FlushCacheReqOutput
from sglite.srt.managers.schedule_batch import Req, ScheduleBatch
from sglite.srt.mem_cache.paging import pages_needed

if TYPE_CHECKING:
    from sglite.srt.managers.scheduler import Scheduler

logger = logging.getLogger("sglite.srt.managers.scheduler")


class SchedulerMemoryMixin:
    """KV slot allocation, release and retraction over the worker's pools (mixed into Scheduler)."""

    def _check_row_room(self: "Scheduler", t: int) -> None:
        """Every running request's row has room for t more slots (else the plan sized rows wrong)."""
        cols = self.req_to_token_pool.req_to_token.shape[1]
        for req in self.running:
            if req.kv_len + t > cols:
                raise RuntimeError(
                    f"request {req.rid} needs {req.kv_len + t} req_to_token columns but rows hold {cols}; "
                    "the req_to_token pool must be sized context_len + num_decode_tokens_per_req"
                )

    def _retract(self: "Scheduler", req: Req) -> None:
        """Free a request's own KV and its row, unlock its prefix, and requeue it at the front."""
        self.worker.flush_deferred_kv()  # K/V a worker deferred must land before the slots change hands
        self._free_positions(req, req.prefix_len, req.kv_len)
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting_queue.insert(0, req)
        self.new_token_ratio = self.config.init_new_token_ratio
        logger.info("retracted request %s (%d running left)", req.rid, len(self.running))

    def _release(self: "Scheduler", req: Req) -> None:
        """Hand a finished/aborted request's KV to the prefix cache and free its row."""
        if req.req_pool_idx is None:
            return
        self.worker.flush_deferred_kv()  # K/V a worker deferred must land before the slots change hands
        row = req.req_pool_idx
        indices = self.req_to_token_pool.req_to_token[row, : req.kv_len].to(torch.int64).clone()
        self.tree_cache.cache_finished_req(req.all_token_ids[: req.kv_len], indices, req.prefix_len, req.last_node)
        self.req_to_token_pool.free(row)
        req.reset_kv_state()

    def _position_slots(self: "Scheduler", req: Req, start: int, end: int) -> torch.Tensor:
        """The request's slots at positions [start, end) (a copy, empty when end <= start)."""
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, start:max(start, end)].to(torch.int64)

    def _free_positions(self: "Scheduler", req: Req, start: int, end: int) -> None:
        """Free the request's own slots at positions [start, end) (``start`` page-aligned or == prefix)."""
        if end > start:
            self.allocator.free(self._position_slots(req, start, end))

    def _alloc_extend(self: "Scheduler", reqs: Sequence[Req], prefix: list[int], seq: list[int]) -> Optional[torch.Tensor]:
        """Slots for positions [prefix, seq) of each request, evicting from the prefix cache if short."""
        if self.page_size == 1:  # no page tails to fill: one slice of the free list
            need = sum(s - p for p, s in zip(prefix, seq))
            loc = self.allocator.alloc(need)
            if loc is None:
                self.tree_cache.evict(need - self.allocator.available_size())
                loc = self.allocator.alloc(need)
            return loc
        table = self.req_to_token_pool.req_to_token
        # One gather (one device sync) for every request's last slot; prefix 0 reads column 0, ignored.
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=table.device)
        cols = torch.tensor([max(p - 1, 0) for p in prefix], dtype=torch.int64, device=table.device)
        last_locs = [loc if p > 0 else 0 for loc, p in zip(table[rows, cols].tolist(), prefix)]
        loc = self.allocator.alloc_extend(prefix, seq, last_locs)
        if loc is None:
            need = sum(pages_needed(p, s - p, self.page_size) for p, s in zip(prefix, seq))
            self.tree_cache.evict(need - self.allocator.available_size())
            loc = self.allocator.alloc_extend(prefix, seq, last_locs)
        return loc

    def _write_decode_slots(self: "Scheduler", reqs: Sequence[Req], loc: torch.Tensor, t: int) -> None:
        """Write each request's t decode slots at positions [kv_len, kv_len + t) of its row (one write for all)."""
        table = self.req_to_token_pool.req_to_token
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=table.device)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=table.device)[:, None]
        cols = cols + torch.arange(t, dtype=torch.int64, device=table.device)[None, :]
        table[rows[:, None], cols] = loc.view(len(reqs), t).to(table.device, table.dtype)

    def _build_prefill_batch(
        self: "Scheduler", admitted: list[tuple[Req, int]], may_fail: bool = False
    ) -> Optional[ScheduleBatch]:
        """An EXTEND batch of (request, tokens to prefill now), its slots allocated and written into req_to_token."""
        reqs = [r for r, _ in admitted]
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + n for r, n in admitted]
        loc = self._alloc_extend(reqs, prefix, seq)
        if loc is None:
            if may_fail:
                return None
            raise RuntimeError("prefill admission promised KV slots that the allocator could not provide")
        input_ids: list[int] = []
        offset = 0
        for (req, n), p in zip(admitted, prefix):
            input_ids.extend(req.all_token_ids[p : p + n])
            self.req_to_token_pool.write(req.req_pool_idx, p, loc[offset : offset + n])
            offset += n
        return ScheduleBatch(
            reqs=reqs,
            is_prefill=True,
            input_ids=input_ids,
            prefix_lens=prefix,
            extend_lens=[n for _, n in admitted],
            out_cache_loc=loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
        )

    def _build_decode_batch(self: "Scheduler", reqs: list[Req], loc: torch.Tensor, t: int) -> ScheduleBatch:
        """A decode batch over ``reqs``, their ``t`` slots each (``loc``) written into req_to_token first."""
        self._write_decode_slots(reqs, loc, t)
        return ScheduleBatch(
            reqs=reqs,
            is_prefill=False,
            input_ids=[r.last_token_id for r in reqs],
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=[t] * len(reqs),
            out_cache_loc=loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
        )

    def _no_room_message(self: "Scheduler", req: Req) -> str:
        """The abort reason of a request that cannot fit even alone."""
        return (
            f"request {req.rid} cannot get KV slots even with nothing else running "
            f"({self.allocator.available_size()} free); raise the KV budget or lower max_new_tokens"
        )

    def flush_cache(self: "Scheduler") -> FlushCacheReqOutput:
        """Drop the prefix cache; refused while requests are in flight."""
        if self.waiting_queue or self.running or self.chunked_req is not None or self.disagg.has_work():
            return FlushCacheReqOutput(success=False, message="cannot flush the cache while requests are running")
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return FlushCacheReqOutput(success=True)
