"""Prefill node: after a request's prefill, ship its target + draft KV and first token, then finish it.

The request keeps its req_to_token row and slots (so nothing can evict them) until the transfer
reaches Success or Failed; only then does the scheduler release it (its KV joins the prefix cache).
A prefill node never decodes, so it reserves no decode block and allocates no verify scratch.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglite.srt.disaggregation.base import KVPoll, PDRank, SchedulerDisagg
from sglite.srt.disaggregation.bootstrap_server import BootstrapServer
from sglite.srt.disaggregation.kv_manager import PrefillKVManager
from sglite.srt.disaggregation.transfer_backend import create_transfer_backend
from sglite.srt.disaggregation.utils import agree_poll, transferable_kv_buffers
from sglite.srt.managers.io_struct import finish_abort, finish_length
from sglite.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class PrefillHandoff(SchedulerDisagg):
    """Turns finished prefills into KV transfers and finishes each request when its transfer ends."""

    def __init__(self, scheduler: Any, manager: PrefillKVManager, tp_group: Optional[Any] = None,
                 bootstrap_server: Optional[BootstrapServer] = None) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self.tp_group = tp_group
        self.bootstrap_server = bootstrap_server
        self.inflight: list[Req] = []
        self.num_transferred = 0
        self.num_failed = 0

    @classmethod
    def create(cls, scheduler: Any, worker: Any, server_args: Any, rank: PDRank, group: Optional[Any]) -> "PrefillHandoff":
        """Start the bootstrap server (engine rank 0) and register this rank's KV buffers and place with it."""
        server = None
        if rank.engine_rank == 0:
            server = BootstrapServer(server_args.host, server_args.disaggregation_bootstrap_port)
        url = f"http://{server_args.host}:{server_args.disaggregation_bootstrap_port}"
        manager = PrefillKVManager(
            create_transfer_backend(server_args.disaggregation_transfer_backend, server_args.host),
            transferable_kv_buffers(worker),
            rank=rank,
            bootstrap_url=url,
            host=server_args.host,
            timeout_s=server_args.disaggregation_transfer_timeout,
        )
        return cls(scheduler, manager, group, server)

    def hand_off(self, req: Req, first_token: int, first_token_logprob: Optional[float] = None) -> bool:
        """The request's prompt is prefilled: send its KV rows and first token (+ its logprob) to the decode node."""
        if req.bootstrap_room is None:
            self.scheduler._finish_now(req, finish_abort(
                "this is a prefill node (--disaggregation-mode prefill): requests need bootstrap_room, "
                "sent by a PD router", status_code=400))
            return True
        req.output_ids.append(int(first_token))
        if req.return_logprob:
            if first_token_logprob is None:
                raise RuntimeError("return_logprob request handed off without the first token's logprob")
            req.output_token_logprobs.append(float(first_token_logprob))
        src = self.scheduler.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.origin_input_ids)]
        meta = {"cached_tokens": req.cached_tokens, "prompt_tokens": len(req.origin_input_ids),
                "first_token_logprob": first_token_logprob}
        self.manager.send(req.bootstrap_room, src.tolist(), int(first_token), meta)
        self.inflight.append(req)
        return True

    def step(self) -> None:
        """One scheduler step: finish requests whose transfer ended."""
        self.poll()

    def has_work(self) -> bool:
        """Requests whose KV is still being shipped."""
        return bool(self.inflight)

    def live_reqs(self) -> list[Req]:
        """Every request held here (for aborts and duplicate-id checks)."""
        return list(self.inflight)

    def poll(self) -> None:
        """Finish requests whose transfer ended (same decision on every TP rank)."""
        still = []
        for req in self.inflight:
            state = agree_poll(self.manager.poll(req.bootstrap_room), self.tp_group)
            if state == KVPoll.Success:
                self.num_transferred += 1
                self._finish(req, finish_length(1))
            elif state == KVPoll.Failed:
                self.num_failed += 1
                error = self.manager.error(req.bootstrap_room) or "KV transfer failed"
                logger.warning("room %s: %s", req.bootstrap_room, error)
                self._finish(req, finish_abort(f"KV transfer to the decode node failed: {error}", status_code=500))
            else:
                still.append(req)
        self.inflight = still

    def _finish(self, req: Req, reason: dict) -> None:
        self.manager.release(req.bootstrap_room)
        req.finished_reason = reason
        self.scheduler._release(req)
        self.scheduler._touch(req)

    def abort(self, req: Req, reason: dict) -> bool:
        """Drop an in-flight request (client abort); its slots are released. False if not held here."""
        if any(r is req for r in self.inflight):
            self.inflight = [r for r in self.inflight if r is not req]
            self._finish(req, reason)
            return True
        return False

    def close(self) -> None:
        """Stop the transfer threads and the bootstrap server."""
        self.manager.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()

    def state(self) -> dict[str, int]:
        """Counters for /get_server_info."""
        return {"num_prefill_inflight_reqs": len(self.inflight), "num_kv_transferred": self.num_transferred,
                "num_kv_transfer_failed": self.num_failed}
