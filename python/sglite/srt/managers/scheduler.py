"""Scheduler: continuous batching over a model worker, with a radix prefix cache.

One ``step()``:
1. assemble a prefill batch from the chunked request (if any) and the waiting queue (lpm / fcfs),
   bounded by free KV slots (+ evictable cache), ``max_running_requests`` and the chunk budget;
2. if there is one, run it (prefill has priority, as in SGLang; with ``--enable-mixed-chunk``, the CPU
   default, the running requests decode inside it and its prefill share is ``--mixed-chunk-prefill-size``
   tokens); otherwise run one decode step for every running request,
   retracting requests (a half-prefilled chunk first, then the least advanced decoding request: free
   their KV, requeue them) while the step's slots cannot be found even after evicting the prefix cache;
3. apply finish conditions token by token, release finished requests, emit a ``BatchTokenIDOut``.

Parts (SGLang's names): ``scheduler_output_processor_mixin`` (step 3), ``scheduler_memory_mixin`` (KV
slots), ``scheduler_metrics_mixin``, ``scheduler_dp_attn_mixin``, ``scheduler_process`` (process entry),
and ``self.disagg`` (``disaggregation.base.SchedulerDisagg``: PD, a no-op without it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sglite.srt.disaggregation.base import SchedulerDisagg
from sglite.srt.managers.base_model_worker import BaseModelWorker
from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    TokenizedGenerateReqInput,
    finish_abort,
)
from sglite.srt.managers.schedule_batch import Req, ScheduleBatch
from sglite.srt.managers.schedule_policy import (
    AddResult,
    PrefillBudget,
    SchedulePolicy,
    decode_reserve,
    mixed_prefill_share,
    prefix_key,
)
from sglite.srt.managers.scheduler_dp_attn_mixin import SchedulerDPAttentionMixin
from sglite.srt.managers.scheduler_fault_isolation_mixin import SchedulerFaultIsolationMixin
from sglite.srt.managers.scheduler_memory_mixin import SchedulerMemoryMixin
from sglite.srt.managers.scheduler_metrics_mixin import SchedulerMetricsMixin
from sglite.srt.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin
from sglite.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglite.srt.mem_cache.chunk_cache import ChunkCache
from sglite.srt.mem_cache.paging import request_kv_slots
from sglite.srt.mem_cache.radix_cache import RadixCache
from sglite.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# How long rank 0 waits for input while idle before it broadcasts an empty batch to its TP peers
# (keeps their blocking broadcast well inside --dist-timeout).
IDLE_POLL_MS = 1000
# PD: while only KV transfers are in flight, wait this long for input instead of spinning on them.
PD_TRANSFER_POLL_MS = 2


@dataclass
class SchedulerConfig:
    """Scheduling knobs that are not server flags (SGLang's defaults)."""

    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001


class Scheduler(
    SchedulerOutputProcessorMixin,
    SchedulerMemoryMixin,
    SchedulerMetricsMixin,
    SchedulerDPAttentionMixin,
    SchedulerFaultIsolationMixin,
):
    """Continuous-batching scheduler of one rank; in-process API: add_request / abort / step."""

    def __init__(
        self,
        server_args: ServerArgs,
        worker: BaseModelWorker,
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        config: Optional[SchedulerConfig] = None,
    ) -> None:
        self.server_args = server_args
        self.worker = worker
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.init_config(config)
        self.init_memory_pool_and_cache()
        self.init_running_status()
        self.init_metrics()
        self.init_dp_attention()
        # PD: PrefillHandoff / DecodePrealloc replace this no-op (disaggregation.factory, run_scheduler_process).
        self.disagg: SchedulerDisagg = SchedulerDisagg()

    def init_config(self, config: Optional[SchedulerConfig]) -> None:
        """Scheduling knobs and limits from the server args and the worker's plan."""
        server_args, worker = self.server_args, self.worker
        self.config = config or SchedulerConfig()
        # PD: a prefill node never decodes, so it reserves no future decode tokens at admission.
        self.disaggregation_mode: Optional[str] = server_args.disaggregation_mode
        if self.disaggregation_mode == "prefill" and config is None:
            self.config = SchedulerConfig(init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        self.max_running_requests = int(worker.max_running_requests)
        if server_args.max_running_requests is not None:
            self.max_running_requests = min(self.max_running_requests, server_args.max_running_requests)
        self.max_running_requests = min(self.max_running_requests, worker.req_to_token_pool.size)
        self.context_len = int(worker.context_len)
        self.chunked_prefill_size: Optional[int] = (
            None if server_args.chunked_prefill_size in (None, -1) else int(server_args.chunked_prefill_size)
        )
        # Mixed batches put each decoding request's newest token into the prefill EXTEND; the worker says
        # per step whether that fits its decode (a speculative one: only while it would not draft).
        self.enable_mixed_chunk = server_args.resolved_enable_mixed_chunk()
        # While requests decode, each step's prefill share is small, so a prompt adds a bounded gap per step.
        self.mixed_chunk_prefill_size = server_args.resolved_mixed_chunk_prefill_size()
        # Unless the flag fixes it, the share grows under a burst (schedule_policy.mixed_prefill_share).
        self.mixed_chunk_share_adapts = server_args.mixed_chunk_prefill_size is None

    def init_memory_pool_and_cache(self) -> None:
        """The worker's pools, the prefix cache over them, and the schedule policy."""
        self.req_to_token_pool = self.worker.req_to_token_pool
        self.allocator = self.worker.token_to_kv_pool_allocator
        self.page_size = int(self.allocator.page_size)
        self.cache_enabled = not self.server_args.disable_radix_cache
        self.tree_cache: BasePrefixCache = (
            RadixCache(self.allocator, self.page_size) if self.cache_enabled else ChunkCache(self.allocator, self.page_size)
        )
        self.policy = SchedulePolicy(self.server_args.schedule_policy, self.tree_cache, self.cache_enabled)
        self.initial_free_slots = self.allocator.available_size()

    def init_running_status(self) -> None:
        """Empty queues."""
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = self.config.init_new_token_ratio
        self._touched: dict[str, Req] = {}  # requests with news for the detokenizer this step

    # ================================================================== requests in
    def add_request(self, recv: TokenizedGenerateReqInput) -> None:
        """Queue a tokenized request; an unservable one finishes at once with an abort reason."""
        req = Req(
            rid=recv.rid,
            origin_input_ids=list(recv.input_ids),
            sampling_params=recv.sampling_params,
            input_text=recv.input_text,
            stream=recv.stream,
            return_logprob=bool(recv.return_logprob),
            top_logprobs_num=int(recv.top_logprobs_num),
            logprob_start_len=int(recv.logprob_start_len),
            eos_token_ids=self.eos_token_ids,
            bootstrap_host=recv.bootstrap_host,
            bootstrap_port=recv.bootstrap_port,
            bootstrap_room=recv.bootstrap_room,
        )
        error = self._validate(req)
        if error is not None:
            logger.warning("request %s rejected: %s", req.rid, error)
            req.finished_reason = finish_abort(error)
            self._touch(req)
            return
        cap = self.server_args.max_queued_requests
        if cap is not None and len(self.waiting_queue) >= cap:  # SGLang's --max-queued-requests: shed load early
            req.finished_reason = finish_abort(
                f"the server's request queue is full ({cap} waiting, --max-queued-requests); retry later",
                status_code=503,
            )
            self._touch(req)
            return
        if self.disagg.add(req):  # PD decode node: the KV comes from a prefill node
            return
        self.waiting_queue.append(req)

    def _validate(self, req: Req) -> Optional[str]:
        n = len(req.origin_input_ids)
        max_new = req.sampling_params.max_new_tokens
        if n == 0:
            return "the prompt is empty (0 tokens)"
        if any(r.rid == req.rid for r in self._all_live_reqs()):
            return f"request id {req.rid!r} is already in use"
        if n + max_new > self.context_len:
            return f"prompt ({n}) + max_new_tokens ({max_new}) exceeds the context length {self.context_len}"
        need = request_kv_slots(  # PD: a prefill node holds only the prompt's K/V
            n, max_new, self.page_size, self.worker.num_decode_tokens_per_req, self.disaggregation_mode == "prefill"
        )
        if need > self.initial_free_slots:
            return (
                f"the request needs {need} KV slots but the pool holds {self.initial_free_slots}; "
                "lower max_new_tokens or raise the KV budget (--mem-fraction-static / --cpu-kv-cache-budget-mb)"
            )
        if req.sampling_params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer in the scheduler"
        if req.return_logprob and not self.worker.supports_logprobs:
            return f"return_logprob is not supported by {type(self.worker).__name__} (speculative decoding)"
        if (req.top_logprobs_num or req.input_logprob_start is not None) and self.disaggregation_mode != "null":
            return "top and prompt logprobs are not carried across a PD handoff; ask a non-disaggregated server"
        return None

    def abort_request(self, recv: AbortReq) -> None:
        """Abort one request (or all): free its slots and report it finished with an abort reason."""
        for req in list(self._all_live_reqs()):
            if recv.abort_all or req.rid == recv.rid:
                self._finish_now(req, finish_abort(recv.message))

    def _finish_now(self, req: Req, reason: dict[str, Any]) -> None:
        """End a request wherever it is (waiting, chunked, running, PD queues)."""
        if self.disagg.abort(req, reason):  # PD: it frees the slots it holds
            return
        req.finished_reason = reason
        if reason.get("type") == "abort":
            logger.info("Abort request %s: %s", req.rid, reason.get("message"))
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self._touch(req)

    def _all_live_reqs(self) -> list[Req]:
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return self.waiting_queue + chunked + self.running + self.disagg.live_reqs()

    # ================================================================== the loop body
    def step(self) -> list[BatchTokenIDOut]:
        """One scheduling step: a prefill batch if one can be formed, else a decode step.

        Under DP attention a step always runs exactly one worker forward: an IDLE one when this
        group has nothing to run (the event loop only steps when some group has work).
        """
        self.disagg.step()  # PD: finish handed-off prefills / admit arrived KV
        batch = self._get_new_prefill_batch()
        forwarded = False
        if batch is not None:
            self._run_prefill(batch)
            forwarded = True
        elif self.running:
            forwarded = self._run_decode()
        self.run_idle_if_needed(forwarded)
        return self._collect_outputs()

    def has_work(self) -> bool:
        """Whether a step would do anything (requests in flight or outputs pending)."""
        return bool(self.waiting_queue or self.running or self.chunked_req or self._touched or self.disagg.has_work())

    def _only_waiting_on_transfers(self) -> bool:
        """PD: nothing to compute, only KV transfers in flight (the loop sleeps briefly instead of spinning)."""
        return not (self.waiting_queue or self.running or self.chunked_req or self._touched) and self.has_work()

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[BatchTokenIDOut]:
        """Step until no request is left; return every output message."""
        outs: list[BatchTokenIDOut] = []
        for _ in range(max_steps):
            if not self.sync_dp_groups():
                return outs
            had_work = self.has_work()  # under DP attention a step may only serve other groups
            forwards = self.num_prefill_forwards + self.num_decode_forwards
            step_outs = self.step()
            outs.extend(step_outs)
            if self._only_waiting_on_transfers():
                time.sleep(0.001)
                continue
            if had_work and not step_outs and forwards == self.num_prefill_forwards + self.num_decode_forwards:
                raise RuntimeError(
                    f"scheduler is stuck: {len(self.waiting_queue)} waiting requests cannot be admitted "
                    f"({self.allocator.available_size()} free slots, {self.tree_cache.evictable_size()} evictable)"
                )
        raise RuntimeError(f"run_until_idle: still busy after {max_steps} steps")

    # ================================================================== prefill
    def _get_new_prefill_batch(self) -> Optional[ScheduleBatch]:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        # Running requests keep room for their next decode step and a share of their remaining tokens.
        running_reserve = sum(decode_reserve(r, self.new_token_ratio) for r in self.running)
        running_reserve += len(self.running) * self.worker.num_decode_tokens_per_req
        mix = self.enable_mixed_chunk and bool(self.running) and self.worker.mixes_decode(len(self.running))
        chunk_budget = self.chunked_prefill_size
        if mix and chunk_budget is not None:
            chunk_budget = max(0, chunk_budget - len(self.running))  # decoding tokens share the forward
        if mix and self.mixed_chunk_prefill_size is not None:
            base = self.mixed_chunk_prefill_size
            if self.mixed_chunk_share_adapts:
                waiting = len(self.waiting_queue) + (self.chunked_req is not None)
                chunk_budget = mixed_prefill_share(base, chunk_budget, waiting, len(self.running))
            else:
                chunk_budget = base if chunk_budget is None else min(chunk_budget, base)
        budget = PrefillBudget(
            rem_kv_tokens=0,  # set per offer below: the evictable size moves as prefixes get locked
            rem_chunk_tokens=chunk_budget,
            page_size=self.page_size,
            new_token_ratio=self.new_token_ratio,
        )
        admitted: list[tuple[Req, int]] = []  # (req, tokens to prefill now)
        used_kv = 0

        def offer(req: Req, force: bool) -> AddResult:
            nonlocal used_kv
            free = self.allocator.available_size() + self.tree_cache.evictable_size()
            budget.rem_kv_tokens = free - running_reserve - used_kv
            if force:  # nothing else is in flight: admit even if its future decode reserve does not fit
                budget.new_token_ratio = 0.0
            before = budget.rem_kv_tokens
            result, take = budget.offer(req, req.kv_len)
            budget.new_token_ratio = self.new_token_ratio
            if result in (AddResult.ADDED, AddResult.CHUNKED):
                used_kv += before - budget.rem_kv_tokens
                admitted.append((req, take))
            return result

        stop = False
        if self.chunked_req is not None:
            req = self.chunked_req
            result = offer(req, force=not self.running)
            if result == AddResult.ADDED:
                self.chunked_req = None
            stop = result != AddResult.ADDED  # still chunked (budget spent) or no room: nothing else this round
            if result == AddResult.NO_TOKENS and not self.running:
                self._finish_now(req, finish_abort(self._no_room_message(req)))
        if not stop:
            for req in self.policy.order(self.waiting_queue):
                if len(self.running) + len(admitted) >= self.max_running_requests:
                    break
                if self.req_to_token_pool.available_size() < 1:
                    break
                match = self.tree_cache.match_prefix(prefix_key(req))
                self.tree_cache.inc_lock_ref(match.last_node)
                req.prefix_indices, req.last_node, req.kv_len = match.indices, match.last_node, match.length
                force = not self.running and not admitted
                result = offer(req, force)
                if result in (AddResult.NO_TOKENS, AddResult.NO_CHUNK_BUDGET):
                    self.tree_cache.dec_lock_ref(match.last_node)
                    req.reset_kv_state()
                    break
                self.waiting_queue.remove(req)
                row = self.req_to_token_pool.alloc(1)
                assert row is not None  # checked available_size above
                req.req_pool_idx = row[0]
                if match.length:
                    self.req_to_token_pool.write(req.req_pool_idx, 0, match.indices)
                if not req.admitted_once:
                    req.cached_tokens, req.admitted_once = match.length, True
                if result == AddResult.CHUNKED:
                    self.chunked_req = req
                    break
        if not admitted:
            return None
        if mix:
            batch = self._build_prefill_batch(admitted + [(r, 1) for r in self.running], may_fail=True)
            if batch is not None:
                return batch
        return self._build_prefill_batch(admitted)

    def _run_prefill(self, batch: ScheduleBatch) -> None:
        self.log_prefill_stats(batch)
        self._forward_isolated(batch, self.process_batch_result_prefill)

    # ================================================================== decode
    def _run_decode(self) -> bool:
        """One decode forward over the running requests; False when retraction left nothing to run."""
        # Asked once per step: a speculative worker decides here whether the step drafts (W slots a request) or
        # not (1: K/V stays contiguous, nothing is freed after). Retraction below only shrinks the batch.
        t = int(self.worker.decode_width(len(self.running)))
        loc = None
        while self.running:
            self._check_row_room(t)
            loc = self._alloc_extend(self.running, [r.kv_len for r in self.running], [r.kv_len + t for r in self.running])
            if loc is not None:
                break
            if self.chunked_req is not None:  # a half-prefilled prompt yields its slots to decoding requests
                req, self.chunked_req = self.chunked_req, None
                self._retract(req)
            elif len(self.running) == 1:
                req = self.running[0]
                self._finish_now(req, finish_abort(self._no_room_message(req)))
                return False
            else:
                # SGLang's choice: fewest generated tokens first, then the longest prompt (frees the most).
                victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
                self.running.remove(victim)
                self._retract(victim)
        if not self.running or loc is None:
            return False
        self._forward_isolated(self._build_decode_batch(list(self.running), loc, t), self.process_batch_result_decode)
        self.new_token_ratio = max(self.config.min_new_token_ratio, self.new_token_ratio - self.config.new_token_ratio_decay)
        self.maybe_log_decode_stats()
        return True

    def handle(self, msg: Any) -> Optional[Any]:
        """Dispatch one incoming message; return a control reply to send back, if any."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            for req in msg.batch:
                self.add_request(req)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        elif isinstance(msg, GetInternalStateReq):
            return GetInternalStateReqOutput(internal_state=self.get_internal_state())
        elif isinstance(msg, HealthCheckReq):
            return HealthCheckOutput(rid=msg.rid)
        else:
            raise TypeError(f"scheduler got an unknown message type {type(msg).__name__}")
        return None

    # ================================================================== process loop
    def event_loop(self, recv_sock: Any, send_sock: Any, tp_group: Any) -> None:
        """Forever: drain pending messages (rank 0, broadcast to TP peers), handle them, step, send."""
        import zmq

        while True:
            msgs: list[Any] = []
            if recv_sock is not None:
                # Under DP attention another group's work keeps this group stepping: don't sleep on input.
                busy = (self.has_work() and not self._only_waiting_on_transfers()) or self._any_group_busy
                idle_poll_ms = self.idle_poll_ms(IDLE_POLL_MS)
                if recv_sock.poll(0 if busy else (PD_TRANSFER_POLL_MS if self.has_work() else idle_poll_ms)):
                    while True:
                        try:
                            msgs.append(recv_sock.recv_pyobj(flags=zmq.NOBLOCK))
                        except zmq.Again:
                            break
            if tp_group is not None:
                msgs = tp_group.broadcast_object(msgs if recv_sock is not None else None, src=0)
            for msg in msgs:
                reply = self.handle(msg)
                if reply is not None and send_sock is not None:
                    send_sock.send_pyobj(reply)
            if self.sync_dp_groups():
                for out in self.step():
                    if send_sock is not None:
                        send_sock.send_pyobj(out)
