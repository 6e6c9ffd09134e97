"""The scheduler's counters and live state (for /get_server_info, /metrics and tests)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglite.srt.managers.scheduler import Scheduler


class SchedulerMetricsMixin:
    """Forward and retraction counters, speculative acceptance, generation throughput (mixed into Scheduler)."""

    def init_metrics(self: "Scheduler") -> None:
        """Zero every counter and start the throughput window."""
        self.num_retractions = 0
        self.num_prefill_forwards = 0
        self.num_decode_forwards = 0
        self.num_idle_forwards = 0
        self.num_failed_requests = 0  # requests ended by an internal fault (failure isolation)
        self.spec_verify_total = 0
        self.spec_accepted_total = 0
        self._gen_tokens_window = 0
        self._gen_window_start = time.monotonic()
        self.last_gen_throughput = 0.0

    def _update_throughput(self: "Scheduler") -> None:
        elapsed = time.monotonic() - self._gen_window_start
        if elapsed >= 1.0:
            self.last_gen_throughput = self._gen_tokens_window / elapsed
            self._gen_tokens_window = 0
            self._gen_window_start = time.monotonic()

    def get_internal_state(self: "Scheduler") -> dict[str, Any]:
        """Live state for /get_server_info."""
        avg_accept = self.spec_accepted_total / self.spec_verify_total if self.spec_verify_total else None
        return {
            "disaggregation_mode": self.disaggregation_mode,
            **self.disagg.state(),
            "available_kv_slots": self.allocator.available_size(),
            "allocator_size": int(self.allocator.size),
            "initial_free_slots": self.initial_free_slots,
            "max_total_num_tokens": int(self.worker.max_total_num_tokens),
            "max_running_requests": self.max_running_requests,
            "tree_cache_size": self.tree_cache.total_size(),
            "tree_cache_evictable": self.tree_cache.evictable_size(),
            "num_running_reqs": len(self.running) + (1 if self.chunked_req is not None else 0),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_retractions": self.num_retractions,
            "num_idle_forwards": self.num_idle_forwards,
            "avg_spec_accept_length": avg_accept,
            "last_gen_throughput": self.last_gen_throughput,
            "memory_plan": self.worker.memory_plan(),
        }
