"""The scheduler's counters and live state (for /get_server_info, /metrics and tests)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglite.srt.managers.schedule_batch import ScheduleBatch
    from sglite.srt.managers.scheduler import Scheduler

# The scheduler's logger: its stats lines read as the scheduler's, as in SGLang.
logger = logging.getLogger("sglite.srt.managers.scheduler")


class SchedulerMetricsMixin:
    """Forward and retraction counters, speculative acceptance, generation throughput (mixed into Scheduler)."""

    def init_metrics(self: "Scheduler") -> None:
        """Zero every counter and start the throughput window."""
        self.num_retractions = 0
        self.num_prefill_forwards = 0
        self.num_decode_forwards = 0
        self.num_idle_forwards = 0
        self.num_failed_requests = 0  # requests ended by an internal fault (failure isolation)
        # Over drafted decode steps only (per request): the draft's accept length, not pulled toward 1 by
        # draft-free steps (--speculative-adaptive, --speculative-disable-by-batch-size).
        self.spec_verify_total = 0
        self.spec_accepted_total = 0
        self.spec_drafted_steps = 0  # speculative decode steps (whole batches) that ran the draft
        self.spec_draft_free_steps = 0  # ... and that decoded with the target alone
        self._gen_tokens_window = 0
        self._gen_window_start = time.monotonic()
        self.last_gen_throughput = 0.0
        # Where the last "Decode batch." line left off (decode steps, spec verifies, accepted tokens).
        self._decode_log_forwards = self._decode_log_verify = self._decode_log_accepted = 0
        self._decode_log_drafted = self._decode_log_draft_free = 0

    def count_spec_step(self: "Scheduler", drafted: bool) -> None:
        """Count one speculative decode step as drafted or draft-free."""
        if drafted:
            self.spec_drafted_steps += 1
        else:
            self.spec_draft_free_steps += 1

    # ------------------------------------------------------------------ stats log lines (SGLang's format)
    def _kv_tokens_used(self: "Scheduler") -> int:
        """Slots held by requests (radix-cached, evictable slots count as free, as in SGLang's token usage)."""
        return self.initial_free_slots - self.allocator.available_size() - self.tree_cache.evictable_size()

    def log_prefill_stats(self: "Scheduler", batch: "ScheduleBatch") -> None:
        """SGLang's "Prefill batch." line, once per prefill forward."""
        running = {id(r) for r in self.running}
        new = [(r, n) for r, n in zip(batch.reqs, batch.extend_lens) if id(r) not in running]
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(new), sum(n for _, n in new), sum(r.prefix_len for r, _ in new if r.kv_len == r.prefix_len),
            self._kv_tokens_used() / self.initial_free_slots, len(self.running), len(self.waiting_queue),
        )

    def maybe_log_decode_stats(self: "Scheduler") -> None:
        """SGLang's "Decode batch." line every --decode-log-interval decode steps (accept len over those steps)."""
        if self.num_decode_forwards - self._decode_log_forwards < self.server_args.decode_log_interval:
            return
        used = self._kv_tokens_used()
        spec = ""
        if self.worker.is_speculative:
            steps = self.spec_verify_total - self._decode_log_verify
            accepted = self.spec_accepted_total - self._decode_log_accepted
            spec = f"accept len: {accepted / steps if steps else 0.0:.2f}, "
            free = self.spec_draft_free_steps - self._decode_log_draft_free
            if free:  # only when the draft was skipped: "draft-free steps: skipped/all"
                spec += f"draft-free steps: {free}/{free + self.spec_drafted_steps - self._decode_log_drafted}, "
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): %.2f, "
            "#queue-req: %d",
            len(self.running), used, used / self.initial_free_slots, spec, self.last_gen_throughput,
            len(self.waiting_queue),
        )
        self._decode_log_forwards = self.num_decode_forwards
        self._decode_log_verify, self._decode_log_accepted = self.spec_verify_total, self.spec_accepted_total
        self._decode_log_drafted, self._decode_log_draft_free = self.spec_drafted_steps, self.spec_draft_free_steps

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
            "spec_drafted_steps": self.spec_drafted_steps,
            "spec_draft_free_steps": self.spec_draft_free_steps,
            "last_gen_throughput": self.last_gen_throughput,
            "memory_plan": self.worker.memory_plan(),
        }
