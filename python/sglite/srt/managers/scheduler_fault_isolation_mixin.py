"""Failure isolation: a fault while serving one request fails that request only.

A forward that raises gets the slots it was given freed and is rerun one request per batch; each
request that raises on its own ends with ``finish_abort(..., status_code=500)`` (its client gets an
internal-server-error response), its KV is released, and the rest of the batch carries on. A fault
that cannot be one request's propagates and ends the process as before: an accelerator error (the
device context is lost for everyone) and any fault under DP attention (the attention-DP groups run
their forwards in lockstep, so one group cannot retry alone).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from sglite.srt.managers.io_struct import finish_abort
from sglite.srt.managers.schedule_batch import Req, ScheduleBatch
from sglite.srt.mem_cache.paging import round_up_to_page

if TYPE_CHECKING:
    from sglite.srt.managers.scheduler import Scheduler

logger = logging.getLogger("sglite.srt.managers.scheduler")


class SchedulerFaultIsolationMixin:
    """Runs worker forwards so that one request's fault fails only that request (mixed into Scheduler)."""

    def _forward_isolated(
        self: "Scheduler", batch: ScheduleBatch, apply: Callable[[ScheduleBatch, list[list[int]]], None]
    ) -> None:
        """Run ``batch`` and ``apply`` its results; after a fault, the same for each request alone.

        ``apply`` runs right after each forward, while the worker's per-step state (``last_step``) is that
        forward's.
        """
        try:
            results = self._forward(batch)
        except Exception as e:
            if not self._isolable(e):
                raise
            error = e
        else:
            apply(batch, results)
            return
        self._undo_slots(batch)
        if batch.batch_size == 1:
            self._fail_request(batch.reqs[0], error)
            return
        logger.warning(
            "a %s batch of %d requests failed (%s: %s); retrying each request alone",
            "prefill" if batch.is_prefill else "decode", batch.batch_size, type(error).__name__, error,
        )
        for req, n in zip(batch.reqs, batch.extend_lens):
            single = self._single_request_batch(batch, req, n)
            try:
                results = self._forward(single)
            except Exception as e:
                if not self._isolable(e):
                    raise
                self._undo_slots(single)
                self._fail_request(req, e)
                continue
            apply(single, results)

    def _forward(self: "Scheduler", batch: ScheduleBatch) -> list[list[int]]:
        if batch.is_prefill:
            results = self.worker.forward_prefill(batch)
            self.num_prefill_forwards += 1
        else:
            results = self.worker.forward_decode(batch)
            self.num_decode_forwards += 1
        return results

    def _isolable(self: "Scheduler", error: Exception) -> bool:
        """Whether a forward fault may be one request's: not under DP attention, not an accelerator fault."""
        if self.dp_peer_group is not None:
            return False
        accelerator_error = getattr(torch, "AcceleratorError", ())
        return not (isinstance(error, accelerator_error) or "CUDA error" in str(error))

    def _undo_slots(self: "Scheduler", batch: ScheduleBatch) -> None:
        """Free the slots a failed forward was given (each request keeps its KV up to kv_len)."""
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.req_pool_idx is not None:
                self._free_positions(req, round_up_to_page(req.kv_len, self.page_size), req.kv_len + n)

    def _single_request_batch(self: "Scheduler", batch: ScheduleBatch, req: Req, n: int) -> ScheduleBatch:
        if batch.is_prefill:
            return self._build_prefill_batch([(req, n)])
        loc = self._alloc_extend([req], [req.kv_len], [req.kv_len + n])
        if loc is None:
            raise RuntimeError("slots freed by a failed decode step could not be allocated again")
        return self._build_decode_batch([req], loc, n)

    def _fail_request(self: "Scheduler", req: Req, error: Exception) -> None:
        """End one request with an internal-error abort (HTTP 500 for it); the server keeps serving."""
        logger.error("request %s failed: %s: %s", req.rid, type(error).__name__, error,
                     exc_info=logger.isEnabledFor(logging.DEBUG))
        self.num_failed_requests += 1
        self._finish_now(
            req, finish_abort(f"internal error while serving this request: {type(error).__name__}: {error}", status_code=500)
        )
