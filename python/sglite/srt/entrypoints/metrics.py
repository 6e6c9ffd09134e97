"""Prometheus metrics of the server (``--enable-metrics``), named as SGLang names them (``sglite:`` prefix)."""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def token_usage(internal_state: dict[str, Any]) -> Optional[float]:
    """SGLang's token_usage: 1 - (free + evictable) / pool slots; None when the state lacks the counts."""
    # Slots only the radix cache holds are reclaimable on demand, so they are not "used" (as in SGLang).
    total = internal_state.get("initial_free_slots")
    free = internal_state.get("available_kv_slots")
    evictable = internal_state.get("tree_cache_evictable")
    if not all(isinstance(v, int) for v in (total, free, evictable)) or total <= 0:
        return None
    return 1.0 - (free + evictable) / total


class ServerMetrics:
    """Per-request counters/histograms fed by the TokenizerManager, scheduler gauges read per scrape."""

    def __init__(self, model_name: str) -> None:
        # A private registry: several servers (or tests) in one process never collide.
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter("sglite:prompt_tokens", "Prompt tokens processed", labels, registry=self.registry)
        self.generation_tokens = Counter("sglite:generation_tokens", "Output tokens generated", labels, registry=self.registry)
        self.cached_tokens = Counter("sglite:cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=self.registry)
        self.num_requests = Counter("sglite:num_requests", "Finished requests by finish reason", labels + ["finish_reason"], registry=self.registry)
        # SGLang's sglang:num_aborted_requests_total: client aborts, refused and failed requests.
        self.num_aborted_requests = Counter("sglite:num_aborted_requests", "Requests that ended with an abort", labels, registry=self.registry)
        self.ttft = Histogram("sglite:time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("sglite:e2e_request_latency_seconds", "End-to-end request latency", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        # Speculative decoding (SGLang's accept length = spec_generation_tokens / spec_verify_steps).
        self.spec_verify_steps = Counter("sglite:spec_verify_steps", "Target verify forwards of speculative requests", labels, registry=self.registry)
        self.spec_generation_tokens = Counter("sglite:spec_generation_tokens", "Output tokens of speculative requests", labels, registry=self.registry)
        # Scheduler totals of speculative decode steps (whole batches) with and without the draft
        # (--speculative-adaptive, --speculative-disable-by-batch-size), advanced per scrape.
        self.spec_step_counters = {
            key: Counter(f"sglite:{key}", help_text, labels, registry=self.registry)
            for key, help_text in (
                ("spec_drafted_steps", "Speculative decode steps that ran the draft"),
                ("spec_draft_free_steps", "Speculative decode steps that decoded with the target alone"),
            )
        }
        self._spec_step_seen: dict[str, int] = {}
        self.tpot = Histogram("sglite:time_per_output_token_seconds", "Mean time per output token after the first", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.gauges = {
            key: Gauge(f"sglite:{key}", help_text, labels, registry=self.registry)
            for key, help_text in (
                ("num_running_reqs", "Requests running in the scheduler"),
                ("num_queue_reqs", "Requests waiting in the scheduler"),
                ("token_usage", "Fraction of KV slots held by requests (radix-cached, evictable slots count as free)"),
                ("gen_throughput", "Last generation throughput (tokens/s)"),
                ("spec_accept_length", "Mean accepted tokens per verify step (bonus included)"),
                ("num_front_end_reqs", "Requests the front end is tracking"),
                # PD disaggregation (only set on prefill / decode nodes).
                ("num_decode_prealloc_queue_reqs", "Decode node: requests waiting for KV slots"),
                ("num_decode_transfer_queue_reqs", "Decode node: requests waiting for their KV"),
                ("num_prefill_inflight_reqs", "Prefill node: requests whose KV is being shipped"),
            )
        }

    def observe_finished(self, state: Any) -> None:
        """Record one finished request (a tokenizer_manager.ReqState)."""
        import time

        m = self.model_name
        now = time.time()
        self.prompt_tokens.labels(m).inc(state.prompt_tokens)
        self.generation_tokens.labels(m).inc(state.completion_tokens)
        self.cached_tokens.labels(m).inc(state.cached_tokens)
        reason_type = str((state.finished_reason or {}).get("type"))
        self.num_requests.labels(m, reason_type).inc()
        if reason_type == "abort":
            self.num_aborted_requests.labels(m).inc()
        if state.spec_verify_ct > 0:
            self.spec_verify_steps.labels(m).inc(state.spec_verify_ct)
            self.spec_generation_tokens.labels(m).inc(state.completion_tokens)
        self.e2e.labels(m).observe(now - state.created_time)
        if state.first_token_time is not None:
            self.ttft.labels(m).observe(state.first_token_time - state.created_time)
            if state.completion_tokens > 1:
                self.tpot.labels(m).observe((now - state.first_token_time) / (state.completion_tokens - 1))

    def render(self, internal_state: dict[str, Any], num_waiting_front_end: int) -> tuple[bytes, str]:
        """Exposition text with the scheduler gauges refreshed from internal_state."""
        m = self.model_name
        g = self.gauges
        g["num_front_end_reqs"].labels(m).set(num_waiting_front_end)
        for key, state_key in (("num_running_reqs", "num_running_reqs"), ("num_queue_reqs", "num_waiting_reqs"),
                               ("gen_throughput", "last_gen_throughput"), ("spec_accept_length", "avg_spec_accept_length"),
                               *((k, k) for k in ("num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs",
                                                  "num_prefill_inflight_reqs"))):
            value = internal_state.get(state_key)
            if isinstance(value, (int, float)):
                g[key].labels(m).set(value)
        for key, counter in self.spec_step_counters.items():
            value, seen = internal_state.get(key), self._spec_step_seen.get(key, 0)
            child = counter.labels(m)  # exported from the first scrape on, 0 until a step counts
            if isinstance(value, int) and value > seen:
                child.inc(value - seen)
                self._spec_step_seen[key] = value
        usage = token_usage(internal_state)
        if usage is not None:
            g["token_usage"].labels(m).set(usage)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
