"""Scheduler: continuous batching over a model worker, with a radix prefix cache.

One ``step()``:
1. assemble a prefill batch from the chunked request (if any) and the waiting queue (lpm / fcfs),
   bounded by free KV slots (+ evictable cache), ``max_running_requests`` and the chunk budget;
2. if there is one, run it (prefill has priority, as in SGLang; with ``--enable-mixed-chunk`` the
   running requests decode inside it); otherwise run one decode step for every running request,
   retracting requests (a half-prefilled chunk first, then the least advanced decoding request: free
   their KV, requeue them) while the step's slots cannot be found even after evicting the prefix cache;
3. apply finish conditions token by token (a speculative step may return several tokens), release
   finished requests into the prefix cache, and return the new tokens as a ``BatchTokenIDOut``.

Slot accounting invariant: ``allocator.available_size() + tree_cache.total_size()`` plus the slots
held by requests in flight equals the allocator's size; with nothing in flight it is the size.

The worker seam (``ModelWorker``): the scheduler allocates KV slots and writes them into
``req_to_token`` before calling ``forward_prefill`` / ``forward_decode``; for decode it allocates
``worker.num_decode_tokens_per_req`` slots per request (1, or the block size B under speculation).
The worker returns each request's new token ids (prefill: 1; decode: 1..B, whose K/V it has written
at the first slots); the scheduler keeps what the finish conditions allow and frees the rest.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    TokenizedGenerateReqInput,
    finish_abort,
    finish_length,
    finish_stop,
)
from sglite.srt.managers.schedule_batch import Req, ScheduleBatch
from sglite.srt.managers.schedule_policy import (
    AddResult,
    PrefillBudget,
    SchedulePolicy,
    decode_reserve,
    pages_needed,
    prefix_key,
)
from sglite.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglite.srt.mem_cache.chunk_cache import ChunkCache
from sglite.srt.mem_cache.radix_cache import RadixCache
from sglite.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# How long rank 0 waits for input while idle before it broadcasts an empty batch to its TP peers
# (keeps their blocking broadcast well inside --dist-timeout).
IDLE_POLL_MS = 1000
# PD: while only KV transfers are in flight, wait this long for input instead of spinning on them.
PD_TRANSFER_POLL_MS = 2
# DP attention: every group's loop meets the others once per iteration, so an idle group that waited
# IDLE_POLL_MS for input would stall a busy group's next step by as much; idle groups poll briefly.
DP_ATTENTION_IDLE_POLL_MS = 5


class ModelWorker(Protocol):
    """What the scheduler needs from a model worker (TpModelWorker, DFlashWorker, test fakes)."""

    req_to_token_pool: Any  # ReqToTokenPool
    token_to_kv_pool_allocator: Any  # PagedTokenToKVPoolAllocator
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    num_decode_tokens_per_req: int  # slots allocated per request per decode step (1, or B for spec)
    is_speculative: bool
    # Optional: ``supports_logprobs = True`` when the worker fills ``batch.next_token_logprobs``.

    def forward_prefill(self, batch: ScheduleBatch) -> list[list[int]]:
        """Run the prefill; return one sampled token per request (ignored for unfinished chunks)."""

    def forward_decode(self, batch: ScheduleBatch) -> list[list[int]]:
        """Run one decode step; return 1..num_decode_tokens_per_req new tokens per request."""

    def memory_plan(self) -> dict[str, Any]:
        """This rank's memory plan (MemoryPoolConfig as a dict)."""

    # Optional, DP attention: ``dp_peer_group`` (the attention-DP peers, None without DP attention)
    # and ``forward_idle()`` (the cross-group collectives of one step, with no tokens).


@dataclass
class SchedulerConfig:
    """Scheduling knobs that are not server flags (SGLang's defaults)."""

    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001


class Scheduler:
    """Continuous-batching scheduler of one rank; in-process API: add_request / abort / step."""

    def __init__(
        self,
        server_args: ServerArgs,
        worker: ModelWorker,
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        config: Optional[SchedulerConfig] = None,
    ) -> None:
        self.server_args = server_args
        self.worker = worker
        self.tokenizer = tokenizer
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.config = config or SchedulerConfig()
        # PD: a prefill node never decodes, so it reserves no future decode tokens at admission.
        self.disaggregation_mode: Optional[str] = server_args.disaggregation_mode
        if self.disaggregation_mode == "prefill" and config is None:
            self.config = SchedulerConfig(init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        # PD: PrefillHandoff / DecodePrealloc (sglite.srt.disaggregation), set by run_scheduler_process.
        self.disagg: Optional[Any] = None
        self.req_to_token_pool = worker.req_to_token_pool
        self.allocator = worker.token_to_kv_pool_allocator
        self.page_size = int(self.allocator.page_size)
        self.max_running_requests = int(worker.max_running_requests)
        if server_args.max_running_requests is not None:
            self.max_running_requests = min(self.max_running_requests, server_args.max_running_requests)
        self.max_running_requests = min(self.max_running_requests, self.req_to_token_pool.size)
        self.context_len = int(worker.context_len)
        self.chunked_prefill_size: Optional[int] = (
            None if server_args.chunked_prefill_size in (None, -1) else int(server_args.chunked_prefill_size)
        )
        self.cache_enabled = not server_args.disable_radix_cache
        # Mixed batches put each decoding request's newest token into the prefill EXTEND; a speculative
        # worker needs its own decode forward, so it never mixes.
        self.enable_mixed_chunk = bool(server_args.enable_mixed_chunk) and not worker.is_speculative
        self.tree_cache: BasePrefixCache = (
            RadixCache(self.allocator, self.page_size) if self.cache_enabled else ChunkCache(self.allocator, self.page_size)
        )
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, self.cache_enabled)
        self.initial_free_slots = self.allocator.available_size()

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = self.config.init_new_token_ratio
        self._touched: dict[str, Req] = {}  # requests with news for the detokenizer this step

        # Counters for /get_server_info and tests.
        self.num_retractions = 0
        self.num_prefill_forwards = 0
        self.num_decode_forwards = 0
        self.num_idle_forwards = 0
        self.spec_verify_total = 0
        self.spec_accepted_total = 0
        self._gen_tokens_window = 0
        self._gen_window_start = time.monotonic()
        self.last_gen_throughput = 0.0

        # DP attention: the groups' MLPs and LM head exchange tokens, so every group runs a forward
        # (an IDLE one if it has nothing) whenever any group does (layers/dp_attention.py).
        self.dp_peer_group = getattr(worker, "dp_peer_group", None)
        if self.dp_peer_group is not None and self.disaggregation_mode in ("prefill", "decode"):
            raise ValueError(
                "--disaggregation-mode with --enable-dp-attention (attention-DP groups > 1) is not supported; "
                "drop --enable-dp-attention on PD nodes"
            )
        self._any_group_busy = False

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
        if self.disagg is not None and self.disaggregation_mode == "decode":  # PD: KV comes from a prefill node
            self.disagg.add(req)
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
        # The last decode step holds K/V for n + max_new - 1 tokens plus its block of slots.
        need = pages_needed(0, n + max_new - 1 + int(self.worker.num_decode_tokens_per_req), self.page_size)
        if self.disaggregation_mode == "prefill":  # PD: a prefill node holds only the prompt's K/V
            need = pages_needed(0, n, self.page_size)
        if need > self.initial_free_slots:
            return (
                f"the request needs {need} KV slots but the pool holds {self.initial_free_slots}; "
                "lower max_new_tokens or raise the KV budget (--mem-fraction-static / --cpu-kv-cache-budget-mb)"
            )
        if req.sampling_params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer in the scheduler"
        if req.return_logprob and not getattr(self.worker, "supports_logprobs", False):
            return f"return_logprob is not supported by {type(self.worker).__name__} (speculative decoding)"
        return None

    def abort_request(self, recv: AbortReq) -> None:
        """Abort one request (or all): free its slots and report it finished with an abort reason."""
        for req in list(self._all_live_reqs()):
            if recv.abort_all or req.rid == recv.rid:
                self._finish_now(req, finish_abort(recv.message))

    def _finish_now(self, req: Req, reason: dict[str, Any]) -> None:
        """End a request wherever it is (waiting, chunked, running, PD queues)."""
        if self.disagg is not None and self.disagg.abort(req, reason):  # PD: it frees the slots it holds
            return
        req.finished_reason = reason
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
        pd = self.disagg.live_reqs() if self.disagg is not None else []
        return self.waiting_queue + chunked + self.running + pd

    # ================================================================== the loop body
    def step(self) -> list[BatchTokenIDOut]:
        """One scheduling step: a prefill batch if one can be formed, else a decode step.

        Under DP attention a step always runs exactly one worker forward: an IDLE one when this
        group has nothing to run (the event loop only steps when some group has work).
        """
        if self.disagg is not None:  # PD: finish handed-off prefills / admit arrived KV
            self.disagg.step()
        batch = self._get_new_prefill_batch()
        forwarded = False
        if batch is not None:
            self._run_prefill(batch)
            forwarded = True
        elif self.running:
            forwarded = self._run_decode()
        if not forwarded and self.dp_peer_group is not None:
            self.worker.forward_idle()
            self.num_idle_forwards += 1
        return self._collect_outputs()

    def sync_dp_groups(self) -> bool:
        """DP attention: whether any attention-DP group has work this iteration (one small all-gather)."""
        if self.dp_peer_group is None:
            return self.has_work()
        # PD is refused with DP attention, so there are no KV transfers to wait on here.
        self._any_group_busy = any(self.dp_peer_group.all_gather_object(self.has_work()))
        return self._any_group_busy

    def has_work(self) -> bool:
        """Whether a step would do anything (requests in flight or outputs pending)."""
        pd = self.disagg is not None and self.disagg.has_work()
        return bool(self.waiting_queue or self.running or self.chunked_req or self._touched or pd)

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
        mix = self.enable_mixed_chunk and bool(self.running)
        chunk_budget = self.chunked_prefill_size
        if mix and chunk_budget is not None:
            chunk_budget = max(0, chunk_budget - len(self.running))  # decoding tokens share the forward
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

    def _build_prefill_batch(self, admitted: list[tuple[Req, int]], may_fail: bool = False) -> Optional[ScheduleBatch]:
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

    def _run_prefill(self, batch: ScheduleBatch) -> None:
        results = self.worker.forward_prefill(batch)
        self.num_prefill_forwards += 1
        if len(results) != batch.batch_size:
            raise RuntimeError(f"worker returned {len(results)} results for {batch.batch_size} requests")
        decoding = {id(r) for r in self.running}  # requests mixed in with one decode token each
        for i, (req, n, tokens) in enumerate(zip(batch.reqs, batch.extend_lens, results)):
            req.kv_len += n
            if req.kv_len < req.seq_len:
                continue  # an unfinished chunk: its sampled token is meaningless
            if len(tokens) != 1:
                raise RuntimeError(f"prefill must return exactly one token per request, got {len(tokens)}")
            if self.disagg is not None and self.disaggregation_mode == "prefill":
                lp = batch.next_token_logprobs[i][0] if req.return_logprob and batch.next_token_logprobs else None
                self.disagg.hand_off(req, tokens[0], lp)  # PD: the decode node continues from here
                continue
            kept = self._append_tokens(req, tokens)
            self._record_logprobs(req, batch, i, kept)
            if req.finished:
                if id(req) in decoding:
                    self.running.remove(req)
                self._release(req)
            elif id(req) not in decoding:
                self.running.append(req)

    # ================================================================== decode
    def _run_decode(self) -> bool:
        """One decode forward over the running requests; False when retraction left nothing to run."""
        t = int(self.worker.num_decode_tokens_per_req)
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
        reqs = list(self.running)
        table = self.req_to_token_pool.req_to_token
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=table.device)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=table.device)[:, None]
        cols = cols + torch.arange(t, dtype=torch.int64, device=table.device)[None, :]
        table[rows[:, None], cols] = loc.view(len(reqs), t).to(table.device, table.dtype)  # one write for all
        batch = ScheduleBatch(
            reqs=reqs,
            is_prefill=False,
            input_ids=[r.last_token_id for r in reqs],
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=[t] * len(reqs),
            out_cache_loc=loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
        )
        results = self.worker.forward_decode(batch)
        self.num_decode_forwards += 1
        if len(results) != len(reqs):
            raise RuntimeError(f"worker returned {len(results)} results for {len(reqs)} requests")
        for i, (req, tokens) in enumerate(zip(reqs, results)):
            if not 1 <= len(tokens) <= t:
                raise RuntimeError(f"decode must return 1..{t} tokens per request, got {len(tokens)}")
            old_kv = req.kv_len
            kept = self._append_tokens(req, tokens)
            if self.worker.is_speculative:
                # Count what the request keeps: a stop inside the accepted run discards the rest.
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += kept
                self.spec_verify_total += 1
                self.spec_accepted_total += kept
            self._record_logprobs(req, batch, i, kept)
            req.kv_len = old_kv + kept
            self._free_positions(req, self._round_up(req.kv_len), old_kv + t)
            if req.finished:
                self.running.remove(req)
                self._release(req)
        self.new_token_ratio = max(self.config.min_new_token_ratio, self.new_token_ratio - self.config.new_token_ratio_decay)
        return True

    def _check_row_room(self, t: int) -> None:
        cols = self.req_to_token_pool.req_to_token.shape[1]
        for req in self.running:
            if req.kv_len + t > cols:
                raise RuntimeError(
                    f"request {req.rid} needs {req.kv_len + t} req_to_token columns but rows hold {cols}; "
                    "the req_to_token pool must be sized context_len + num_decode_tokens_per_req"
                )

    def _retract(self, req: Req) -> None:
        """Free a request's own KV and its row, unlock its prefix, and requeue it at the front."""
        self._free_positions(req, req.prefix_len, req.kv_len)
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting_queue.insert(0, req)
        self.new_token_ratio = self.config.init_new_token_ratio
        logger.info("retracted request %s (%d running left)", req.rid, len(self.running))

    # ================================================================== finish conditions
    def _append_tokens(self, req: Req, tokens: Sequence[int]) -> int:
        """Append tokens one by one until a finish condition hits; return how many were kept."""
        kept = 0
        for tok in tokens:
            req.output_ids.append(int(tok))
            kept += 1
            self._gen_tokens_window += 1
            self._check_finished(req)
            if req.finished:
                break
        self._touch(req)
        return kept

    def _record_logprobs(self, req: Req, batch: ScheduleBatch, i: int, kept: int) -> None:
        """Keep the logprobs of the ``kept`` tokens just appended (when the request asked for them)."""
        if not req.return_logprob:
            return
        if batch.next_token_logprobs is None:
            raise RuntimeError(f"{type(self.worker).__name__} returned no logprobs for a return_logprob batch")
        req.output_token_logprobs.extend(batch.next_token_logprobs[i][:kept])

    def _check_finished(self, req: Req) -> None:
        sp = req.sampling_params
        last = req.output_ids[-1]
        if len(req.output_ids) >= sp.max_new_tokens:
            req.finished_reason = finish_length(sp.max_new_tokens)
        elif last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
            req.finished_reason = finish_stop(last)
        elif req.seq_len >= self.context_len:
            req.finished_reason = finish_length(len(req.output_ids))
        elif sp.stop:
            matched = self._match_stop_str(req)
            if matched is not None:
                req.finished_reason = finish_stop(matched)

    def _match_stop_str(self, req: Req) -> Optional[str]:
        stops = req.sampling_params.stop
        # A stop string of k characters spans at most k tokens (+ a few for byte-level pieces).
        window = max(len(s) for s in stops) + 8
        tail = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        for s in stops:
            if s in tail:
                return s
        return None

    # ================================================================== KV release
    def _release(self, req: Req) -> None:
        """Hand a finished/aborted request's KV to the prefix cache and free its row."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        indices = self.req_to_token_pool.req_to_token[row, : req.kv_len].to(torch.int64).clone()
        self.tree_cache.cache_finished_req(req.all_token_ids[: req.kv_len], indices, req.prefix_len, req.last_node)
        self.req_to_token_pool.free(row)
        req.reset_kv_state()

    def _free_positions(self, req: Req, start: int, end: int) -> None:
        """Free the request's own slots at positions [start, end) (``start`` page-aligned or == prefix)."""
        if end > start:
            self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].to(torch.int64))

    def _round_up(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _alloc_extend(self, reqs: Sequence[Req], prefix: list[int], seq: list[int]) -> Optional[torch.Tensor]:
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

    def _no_room_message(self, req: Req) -> str:
        return (
            f"request {req.rid} cannot get KV slots even with nothing else running "
            f"({self.allocator.available_size()} free); raise the KV budget or lower max_new_tokens"
        )

    # ================================================================== outputs
    def _touch(self, req: Req) -> None:
        self._touched[req.rid] = req

    def _collect_outputs(self) -> list[BatchTokenIDOut]:
        reqs = [r for r in self._touched.values() if r.finished or r.stream]
        self._touched = {rid: r for rid, r in self._touched.items() if not (r.finished or r.stream)}
        self._update_throughput()
        if not reqs:
            return []
        out = BatchTokenIDOut(
            rids=[r.rid for r in reqs],
            output_ids=[r.output_ids[r.sent_len :] for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],
            prompt_tokens=[len(r.origin_input_ids) for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            spec_verify_ct=[r.spec_verify_ct for r in reqs],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
            stop_strs=[list(r.sampling_params.stop) for r in reqs],
            output_token_logprobs=(
                [r.output_token_logprobs[r.sent_len :] if r.return_logprob else None for r in reqs]
                if any(r.return_logprob for r in reqs)
                else None
            ),
        )
        for r in reqs:
            r.sent_len = len(r.output_ids)
        return [out]

    def _update_throughput(self) -> None:
        elapsed = time.monotonic() - self._gen_window_start
        if elapsed >= 1.0:
            self.last_gen_throughput = self._gen_tokens_window / elapsed
            self._gen_tokens_window = 0
            self._gen_window_start = time.monotonic()

    # ================================================================== control
    def flush_cache(self) -> FlushCacheReqOutput:
        """Drop the prefix cache; refused while requests are in flight."""
        if self.waiting_queue or self.running or self.chunked_req is not None or (
            self.disagg is not None and self.disagg.has_work()
        ):
            return FlushCacheReqOutput(success=False, message="cannot flush the cache while requests are running")
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return FlushCacheReqOutput(success=True)

    def get_internal_state(self) -> dict[str, Any]:
        """Live state for /get_server_info."""
        avg_accept = self.spec_accepted_total / self.spec_verify_total if self.spec_verify_total else None
        pd = {"disaggregation_mode": self.disaggregation_mode, **(self.disagg.state() if self.disagg else {})}
        return {
            **pd,
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

    def handle(self, msg: Any) -> Optional[Any]:
        """Dispatch one incoming message; return a control reply to send back, if any."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
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
                idle_poll_ms = IDLE_POLL_MS if self.dp_peer_group is None else DP_ATTENTION_IDLE_POLL_MS
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


# ====================================================================== process entry
def resolve_eos_token_ids(model_path: Optional[str], model_config: Any, tokenizer: Any) -> list[int]:
    """EOS ids as SGLang gathers them: config.json, generation_config.json, and the tokenizer's eos."""
    import json
    import os

    ids: list[int] = list(getattr(model_config, "eos_token_id", None) or [])
    gen_path = os.path.join(model_path, "generation_config.json") if model_path else None
    if gen_path and os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tok_eos, int):
        ids.append(tok_eos)
    return sorted(set(int(i) for i in ids))


def create_model_worker(
    server_args: ServerArgs,
    *,
    rank: int = 0,
    world_size: int = 1,
    dist_init_method: Optional[str] = None,
    dp_rank: int = 0,
) -> Any:
    """The worker for --speculative-algorithm: DFlashWorker for DFLASH/DSPARK, else TpModelWorker."""
    algo = server_args.speculative_algorithm
    if algo in ("DFLASH", "DSPARK"):
        from sglite.srt.speculative.dflash_worker import create_dflash_worker

        return create_dflash_worker(
            server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
        )
    if algo is not None:
        raise ValueError(f"--speculative-algorithm {algo} is not served by sglite's scheduler; use DFLASH or DSPARK")
    from sglite.srt.managers.tp_worker import TpModelWorker

    return TpModelWorker.create(
        server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
    )


def _target_runner(worker: Any) -> Any:
    return getattr(worker, "model_runner", None) or getattr(worker, "target_runner")


def run_scheduler_process(server_args: ServerArgs, port_args: Any, rank: int, world_size: int, pipe_writer: Any) -> None:
    """Process entry of one scheduler rank: build the worker, report ready on the pipe, serve forever.

    Rank 0 pulls requests from the TokenizerManager and pushes outputs to the detokenizer; with TP the
    other ranks receive rank 0's messages by broadcast and run the same schedule in lockstep.
    """
    import traceback

    import zmq

    from sglite.srt.managers.detokenizer_manager import load_tokenizer
    from sglite.srt.managers.data_parallel_controller import rank_report
    from sglite.srt.managers.io_struct import SchedulerInitError, SchedulerReady
    from sglite.srt.managers.subprocess_watchdog import watch_parent

    watch_parent()
    logging.basicConfig(
        level=getattr(logging, str(server_args.log_level).upper(), logging.INFO),
        format=f"[scheduler {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        worker = create_model_worker(
            server_args,
            rank=rank,
            world_size=world_size,
            dist_init_method=port_args.dist_init_method,
            dp_rank=port_args.dp_rank,
        )
        runner = _target_runner(worker)
        tokenizer_path = server_args.tokenizer_path or server_args.model_path
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
        eos = resolve_eos_token_ids(server_args.model_path, runner.model_config, tokenizer)
        scheduler = Scheduler(server_args, worker, tokenizer=tokenizer, eos_token_ids=eos)
        if server_args.disaggregation_mode in ("prefill", "decode"):  # PD: prefill hand-off or decode pre-allocation
            from sglite.srt.disaggregation.utils import create_disagg

            scheduler.disagg = create_disagg(scheduler, worker, server_args, rank, world_size)
        ready = SchedulerReady(
            max_total_num_tokens=int(worker.max_total_num_tokens),
            max_running_requests=scheduler.max_running_requests,
            context_len=scheduler.context_len,
            vocab_size=int(runner.model_config.vocab_size),
            memory_plan=worker.memory_plan(),
            rank_report=rank_report(worker) if _builds_pools(worker) else None,
        )
    except BaseException as e:  # report start-up failures to the launcher, then exit non-zero
        pipe_writer.send(SchedulerInitError(message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))
        raise
    recv_sock = send_sock = None
    # The front of this rank's DP group talks to the outside and broadcasts to the group. The group is
    # the attention-TP group: the TP group without DP attention, one attention-DP group with it.
    bcast_group = None
    is_front = rank == 0
    if world_size > 1:
        from sglite.srt.distributed.parallel_state import get_attn_tp_group

        bcast_group = get_attn_tp_group()
        is_front = bcast_group.is_first_rank
    if is_front:
        ctx = zmq.Context()
        recv_sock = ctx.socket(zmq.PULL)
        recv_sock.bind(port_args.scheduler_input_ipc_name)
        send_sock = ctx.socket(zmq.PUSH)
        send_sock.connect(port_args.detokenizer_ipc_name)
    pipe_writer.send(ready)
    pipe_writer.close()
    scheduler.event_loop(recv_sock, send_sock, bcast_group)


def _builds_pools(worker: Any) -> bool:
    """Whether the worker has real KV pools to report (test fakes have none)."""
    runner = getattr(worker, "model_runner", None) or getattr(worker, "target_runner", None)
    return runner is not None and getattr(runner, "token_to_kv_pool", None) is not None
