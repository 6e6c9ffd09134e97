"""Decode node: pre-allocate a request's slots, receive its KV from the prefill node, then decode it.

Queues (SGLang's names): pre-allocation (waiting for a request row and KV slots for the prompt plus
--num-reserved-decode-tokens of headroom) → transfer (slots handed to the prefill node, waiting for
the KV and the first token) → the scheduler's running batch. With DFLASH the draft KV arrives with
the target KV at the same slots, so the first decode step drafts from the first token with the
whole prompt as draft context; no hidden states travel. A room that fails or times out frees its
pre-allocated slots and its row, and the client gets an error.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglite.srt.disaggregation.base import KVPoll, PDRank, SchedulerDisagg
from sglite.srt.disaggregation.kv_manager import DecodeKVManager
from sglite.srt.disaggregation.transfer_backend import create_transfer_backend
from sglite.srt.disaggregation.utils import agree_poll, transferable_kv_buffers
from sglite.srt.managers.io_struct import finish_abort
from sglite.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class DecodePrealloc(SchedulerDisagg):
    """Pre-allocation and transfer queues in front of the decode scheduler's running batch."""

    def __init__(self, scheduler: Any, manager: DecodeKVManager, num_reserved_decode_tokens: int,
                 tp_group: Optional[Any] = None) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self.reserved = int(num_reserved_decode_tokens)
        self.tp_group = tp_group
        self.prealloc_queue: list[Req] = []
        self.transfer_queue: list[tuple[Req, torch.Tensor]] = []  # (request, its pre-allocated slots)
        # Aborted while their KV was in flight: (room, slots, row, prefix-cache lock). The prefill node may
        # still write into the slots, so they are freed only once the room succeeds, fails or times out.
        self.draining: list[tuple[int, torch.Tensor, int, Any]] = []
        self.num_received = 0
        self.num_failed = 0

    @classmethod
    def create(cls, scheduler: Any, worker: Any, server_args: Any, rank: PDRank, group: Optional[Any]) -> "DecodePrealloc":
        """Register this rank's KV buffers with the transfer backend."""
        manager = DecodeKVManager(
            create_transfer_backend(server_args.disaggregation_transfer_backend, server_args.host),
            transferable_kv_buffers(worker),
            rank=rank,
            host=server_args.host,
            timeout_s=server_args.disaggregation_transfer_timeout,
        )
        return cls(scheduler, manager, server_args.num_reserved_decode_tokens, group)

    # ----------------------------------------------------------------- queue in
    def add(self, req: Req) -> bool:
        """Queue a request that will be prefilled elsewhere (every new request goes here)."""
        if req.bootstrap_room is None or req.bootstrap_host is None:
            self.scheduler._finish_now(req, finish_abort(
                "this is a decode node (--disaggregation-mode decode): requests need bootstrap_host, "
                "bootstrap_port and bootstrap_room, sent by a PD router", status_code=400))
            return True
        self.prealloc_queue.append(req)
        return True

    def has_work(self) -> bool:
        """Requests waiting for slots or for their KV (or aborted rooms whose slots are not free yet)."""
        return bool(self.prealloc_queue or self.transfer_queue or self.draining)

    def live_reqs(self) -> list[Req]:
        """Every request held here (for aborts and duplicate-id checks)."""
        return self.prealloc_queue + [r for r, _ in self.transfer_queue]

    # ----------------------------------------------------------------- one scheduler step
    def step(self) -> None:
        """Pre-allocate what fits, then move arrived rooms into the running batch."""
        self._preallocate()
        self._poll_transfers()
        self._poll_draining()

    def _preallocate(self) -> None:
        s = self.scheduler
        while self.prealloc_queue:
            req = self.prealloc_queue[0]
            n = len(req.origin_input_ids)
            busy = len(s.running) + len(self.transfer_queue)
            headroom = (busy + 1) * self.reserved if busy else 0  # a lone request always gets its chance
            free = s.allocator.available_size() + s.tree_cache.evictable_size()
            if s.req_to_token_pool.available_size() < 1 or free < n + headroom:
                return
            row = s.req_to_token_pool.alloc(1)[0]
            req.req_pool_idx = row
            slots = s._alloc_extend([req], [0], [n])
            if slots is None:
                s.req_to_token_pool.free(row)
                req.req_pool_idx = None
                return
            self.prealloc_queue.pop(0)
            s.req_to_token_pool.write(row, 0, slots)
            match = s.tree_cache.match_prefix([])  # no decode-side prefix reuse: the anchor is the root
            s.tree_cache.inc_lock_ref(match.last_node)
            req.last_node = match.last_node
            self.manager.start(req.bootstrap_room, req.bootstrap_host, int(req.bootstrap_port or 0), slots.tolist())
            self.transfer_queue.append((req, slots))

    def _poll_transfers(self) -> None:
        s = self.scheduler
        still = []
        for req, slots in self.transfer_queue:
            state = agree_poll(self.manager.poll(req.bootstrap_room), self.tp_group)
            if state == KVPoll.Success and len(s.running) < s.max_running_requests:
                first_token, meta = self.manager.result(req.bootstrap_room)
                self.manager.release(req.bootstrap_room)
                self.num_received += 1
                req.kv_len = len(req.origin_input_ids)
                req.cached_tokens = int(meta.get("cached_tokens", 0))
                req.admitted_once = True
                if req.return_logprob:
                    if meta.get("first_token_logprob") is None:
                        self._drop(req, slots, finish_abort(
                            "return_logprob: the prefill node sent no logprob for the first token", status_code=500))
                        continue
                    req.output_token_logprobs.append(float(meta["first_token_logprob"]))
                s._append_tokens(req, [first_token])
                if req.finished:
                    s._release(req)
                else:
                    s.running.append(req)
            elif state == KVPoll.Failed:
                error = self.manager.error(req.bootstrap_room) or "KV transfer failed"
                self.num_failed += 1
                logger.warning("room %s: %s", req.bootstrap_room, error)
                self._drop(req, slots, finish_abort(f"KV from the prefill node never arrived: {error}", status_code=500))
            else:
                still.append((req, slots))
        self.transfer_queue = still

    def _poll_draining(self) -> None:
        s = self.scheduler
        still = []
        for room, slots, row, last_node in self.draining:
            state = agree_poll(self.manager.poll(room), self.tp_group)
            if state in (KVPoll.Success, KVPoll.Failed):
                self.manager.release(room)
                s.allocator.free(slots.to(torch.int64))
                s.tree_cache.dec_lock_ref(last_node)
                s.req_to_token_pool.free(row)
            else:
                still.append((room, slots, row, last_node))
        self.draining = still

    # ----------------------------------------------------------------- failure / abort
    def _drop(self, req: Req, slots: Optional[torch.Tensor], reason: dict) -> None:
        """Free pre-allocated slots (never cached: their KV is not valid) and end the request."""
        s = self.scheduler
        self.manager.release(req.bootstrap_room)
        if slots is not None:
            s.allocator.free(slots.to(torch.int64))
            s.tree_cache.dec_lock_ref(req.last_node)
            s.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()
        req.finished_reason = reason
        s._touch(req)

    def abort(self, req: Req, reason: dict) -> bool:
        """Client abort of a request still held here; False if it is not held here."""
        if any(r is req for r in self.prealloc_queue):
            self.prealloc_queue = [r for r in self.prealloc_queue if r is not req]
            self._drop(req, None, reason)
            return True
        for i, (r, slots) in enumerate(self.transfer_queue):
            if r is req:
                self.transfer_queue.pop(i)
                # The client is answered now; the slots wait until the prefill node can no longer write them.
                self.draining.append((req.bootstrap_room, slots, req.req_pool_idx, req.last_node))
                req.reset_kv_state()
                req.finished_reason = reason
                self.scheduler._touch(req)
                return True
        return False

    def close(self) -> None:
        """Stop the receiver thread."""
        self.manager.close()

    def state(self) -> dict[str, int]:
        """Queue sizes for /get_server_info and metrics (SGLang's gauge names)."""
        return {
            "num_decode_prealloc_queue_reqs": len(self.prealloc_queue),
            "num_decode_transfer_queue_reqs": len(self.transfer_queue),
            "num_decode_draining_reqs": len(self.draining),
            "num_kv_received": self.num_received,
            "num_kv_transfer_failed": self.num_failed,
        }
