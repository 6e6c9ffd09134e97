"""TokenizerManager: the async front half of the server (runs in the HTTP / Engine process).

It tokenizes (chat template included) in a small thread pool off the event loop, validates lengths
against the context length and the KV pool, sends requests to the scheduler, collects text deltas from the detokenizer, streams them, and
aborts requests whose caller went away (a cancelled generator aborts its request in ``finally``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import jinja2

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    PortArgs,
    SchedulerReady,
    TokenizedGenerateReqInput,
    finish_abort,
    TopLogprobs,
)
from sglite.srt.mem_cache.paging import max_new_tokens_that_fit, request_kv_slots
from sglite.srt.managers.template_manager import apply_chat_template_arg
from sglite.srt.sampling.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# Default completion length of a native request that does not set max_new_tokens (SGLang's).
DEFAULT_MAX_NEW_TOKENS = 128
# Threads that tokenize and render chat templates (HF fast tokenizers release the GIL while encoding).
TOKENIZER_THREADS = 4
# Most top logprobs per token a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


class RequestValidationError(ValueError):
    """A request that can never be served as sent (the HTTP layer answers 400).

    ``param`` names the offending field for the OpenAI-style error body."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """A server subprocess died; nothing more can be served."""


@dataclass
class ReqState:
    """Live state of one request in the front end."""

    rid: str
    prompt_tokens: int
    stream: bool
    created_time: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[dict[str, Any]] = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    spec_cap_length: Optional[float] = None
    output_token_logprobs: Optional[list[float]] = None
    output_top_logprobs: Optional[list[TopLogprobs]] = None
    # Prompt logprobs from logprob_start_len: (logprobs, top-k), None entries where there is none.
    input_token_logprobs: Optional[tuple[list[Optional[float]], list[Optional[TopLogprobs]]]] = None
    input_ids: list[int] = field(default_factory=list)
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    first_token_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        """The request has its final output."""
        return self.finished_reason is not None


class TokenizerManager:
    """Tokenize + validate + send; receive + stream; abort on disconnect."""

    def __init__(
        self,
        server_args: Any,
        port_args: PortArgs,
        tokenizer: Any,
        scheduler_info: SchedulerReady,
        *,
        on_request_finished: Optional[Callable[[ReqState], None]] = None,
        child_processes: Sequence[tuple[str, Any]] = (),
    ) -> None:
        import zmq
        import zmq.asyncio

        self.server_args = server_args
        self.tokenizer = tokenizer
        apply_chat_template_arg(tokenizer, getattr(server_args, "chat_template", None))
        self.scheduler_info = scheduler_info
        self.context_len = scheduler_info.context_len
        self.vocab_size = scheduler_info.vocab_size
        self.on_request_finished = on_request_finished
        self.context = zmq.asyncio.Context(2)
        self.send_to_scheduler = self.context.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.recv_from_detokenizer = self.context.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.rid_to_state: dict[str, ReqState] = {}
        self._control_waiters: dict[type, deque[asyncio.Future]] = {
            FlushCacheReqOutput: deque(), GetInternalStateReqOutput: deque(), HealthCheckOutput: deque()
        }
        self._handle_task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        # (name, multiprocessing.Process) of the scheduler ranks and the detokenizer, watched for death.
        self.child_processes: Sequence[tuple[str, Any]] = child_processes
        self.dead_reason: Optional[str] = None
        self.num_finished = 0
        self.num_aborted = 0
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")

    async def run_off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in the tokenizer threads, so a huge prompt or a slow template delays no other request."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------ tokenization / validation
    def tokenize_request(self, obj: GenerateReqInput, *, fill_context: bool = False) -> list[TokenizedGenerateReqInput]:
        """Validate and tokenize every prompt of obj (raises RequestValidationError; sends nothing).

        Without an explicit max_new_tokens a native request gets DEFAULT_MAX_NEW_TOKENS; with
        ``fill_context`` (OpenAI requests without max_tokens) it may run to the end of the context.
        """
        try:
            parts = obj.split()
        except ValueError as e:
            raise RequestValidationError(str(e)) from None
        tokenized = []
        for part in parts:
            tokenized.extend(self._fan_out(self.tokenize_one(part, fill_context=fill_context)))
        self._check_rids_free(tokenized)
        return tokenized

    @staticmethod
    def _fan_out(req: TokenizedGenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """n > 1: n independent requests ``{rid}-{k}`` of the same prompt (SGLang's parallel sampling).

        A seeded request gives copy k the seed ``seed + k`` so the n choices differ yet reproduce.
        """
        n = req.sampling_params.n
        if n == 1:
            return [req]
        seed = req.sampling_params.seed
        return [
            dataclasses.replace(
                req, rid=f"{req.rid}-{k}",
                sampling_params=dataclasses.replace(req.sampling_params, n=1, seed=None if seed is None else seed + k),
            )
            for k in range(n)
        ]

    def _check_rids_free(self, tokenized: list[TokenizedGenerateReqInput]) -> None:
        rids = [t.rid for t in tokenized]
        for rid in rids:
            if rid in self.rid_to_state or rids.count(rid) > 1:
                raise RequestValidationError(f"rid {rid!r} is already in use", "rid")

    def tokenize_one(self, obj: GenerateReqInput, *, fill_context: bool = False) -> TokenizedGenerateReqInput:
        """Validate a single (non-batch) request and turn it into the scheduler's message."""
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)  # type: ignore[arg-type]
            bad = [t for t in input_ids if t < 0 or t >= self.vocab_size]
            if bad:
                raise RequestValidationError(
                    f"input_ids contains token id {bad[0]} outside the vocabulary [0, {self.vocab_size})", "input_ids"
                )
            input_text = None
        else:
            input_text = obj.text  # type: ignore[assignment]
            input_ids = self.tokenizer.encode(input_text)
        if not input_ids:
            raise RequestValidationError("the prompt is empty (0 tokens)", "prompt")
        if not _is_int(obj.logprob_start_len) or obj.logprob_start_len < -1:
            raise RequestValidationError(f"logprob_start_len must be an integer >= -1, got {obj.logprob_start_len!r}", "logprob_start_len")
        if obj.return_logprob and obj.logprob_start_len >= len(input_ids):
            raise RequestValidationError(
                f"logprob_start_len {obj.logprob_start_len} must be below the prompt length {len(input_ids)} "
                "(-1: no prompt logprobs)", "logprob_start_len",
            )
        if not _is_int(obj.top_logprobs_num) or not 0 <= obj.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestValidationError(
                f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {obj.top_logprobs_num!r}", "top_logprobs_num"
            )
        sp_dict = dict(obj.sampling_params or {})  # type: ignore[arg-type]
        try:
            params = SamplingParams.from_dict(sp_dict)
        except TypeError as e:
            raise RequestValidationError(f"invalid sampling_params: {e}", "sampling_params") from None
        n_in = len(input_ids)
        if n_in >= self.context_len:
            raise RequestValidationError(
                f"The input ({n_in} tokens) is longer than the model's context length ({self.context_len} tokens).",
                "prompt",
            )
        capacity = self.scheduler_info.max_total_num_tokens
        page = max(1, int(getattr(self.server_args, "page_size", 1) or 1))
        decode_slots = self.scheduler_info.num_decode_tokens_per_req
        prefill_only = getattr(self.server_args, "disaggregation_mode", None) == "prefill"
        if sp_dict.get("max_new_tokens") is None:
            # What the context and the pool leave, by the pool check's own formula (a speculative step holds a
            # block of slots beyond the last token), so a request without max_tokens is never refused for it.
            fits = capacity - n_in if prefill_only else max_new_tokens_that_fit(n_in, capacity, page, decode_slots)
            room = min(self.context_len - n_in, fits)
            params.max_new_tokens = max(1, room if fill_context else min(DEFAULT_MAX_NEW_TOKENS, room))
        try:
            params.verify(self.vocab_size)
        except SamplingParamsError as e:
            field_name = str(e).split(" ", 1)[0]
            raise RequestValidationError(str(e), field_name) from None
        if n_in + params.max_new_tokens > self.context_len:
            raise RequestValidationError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {n_in + params.max_new_tokens} tokens: {n_in} tokens from the input "
                f"and {params.max_new_tokens} tokens for the completion. Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        need = request_kv_slots(  # the scheduler's own formula: it would abort what does not fit
            n_in, params.max_new_tokens, page, decode_slots, prefill_only=prefill_only
        )
        if need > capacity:
            raise RequestValidationError(
                f"The request needs {need} KV slots but the server's KV pool holds "
                f"{capacity}; reduce the prompt or max_tokens (or raise the server's memory budget).",
                "max_tokens",
            )
        return TokenizedGenerateReqInput(
            rid=obj.rid,  # type: ignore[arg-type]
            input_text=input_text,
            input_ids=input_ids,
            sampling_params=params,
            stream=obj.stream,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
            return_text_in_logprobs=obj.return_text_in_logprobs,
            bootstrap_host=obj.bootstrap_host,  # type: ignore[arg-type]
            bootstrap_port=obj.bootstrap_port,  # type: ignore[arg-type]
            bootstrap_room=obj.bootstrap_room,  # type: ignore[arg-type]
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], chat_template_kwargs: Optional[dict] = None, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for chat messages, from the tokenizer's template (or --chat-template's)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestValidationError(
                "this model's tokenizer has no chat template; use /v1/completions or /generate", "messages"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
        except (TypeError, ValueError, KeyError, jinja2.TemplateError) as e:
            raise RequestValidationError(f"could not apply the chat template: {e}", "messages") from None

    # ------------------------------------------------------------------ request lifecycle
    async def generate_request(
        self, obj: GenerateReqInput, tokenized: Optional[list[TokenizedGenerateReqInput]] = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield outputs: for a stream every update, else one final output per prompt.

        Each output is ``{"text", "output_ids", "meta_info", "index", "delta_text", "delta_output_ids"}``
        (``text`` / ``output_ids`` cumulative). All prompts of a batch are validated before any is sent;
        pass ``tokenized`` (from ``tokenize_request``) to validate before committing to a response.
        """
        self._ensure_running()
        if tokenized is None:
            tokenized = self.tokenize_request(obj)
        else:
            self._check_rids_free(tokenized)  # all or nothing: a clash must not leave half a batch running
        states = self._send(tokenized)
        if len(states) == 1:
            async for out in self._wait_one(states[0], 0):
                yield out
            return
        # Batch: interleave the per-prompt streams.
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, st: ReqState) -> None:
            try:
                async for out in self._wait_one(st, i):
                    await queue.put(out)
            except BaseException as e:  # forwarded to the consumer, which re-raises it
                await queue.put(e)
                return
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(states)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            for st in states:
                if not st.finished and st.rid in self.rid_to_state:
                    self.abort_request(st.rid)

    def _send(self, reqs: list[TokenizedGenerateReqInput]) -> list[ReqState]:
        """Register each request's state, then send them as one message (a batch is admitted together)."""
        states = []
        for req in reqs:
            state = ReqState(
                rid=req.rid, prompt_tokens=len(req.input_ids), stream=req.stream, created_time=time.time(),
                return_text_in_logprobs=req.return_text_in_logprobs, input_ids=req.input_ids,
                logprob_start_len=req.logprob_start_len,
            )
            self.rid_to_state[req.rid] = state
            states.append(state)
        self.send_to_scheduler.send_pyobj(reqs[0] if len(reqs) == 1 else BatchTokenizedGenerateReqInput(batch=list(reqs)))
        return states

    async def _wait_one(self, state: ReqState, index: int) -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    self._raise_if_dead()
                    continue
                state.event.clear()
                self._raise_if_dead()
                out = self._make_output(state, index)
                if state.finished:
                    yield out
                    return
                if state.stream and (out["delta_text"] or out["delta_output_ids"]):
                    yield out
        finally:
            if not state.finished and state.rid in self.rid_to_state:
                # The caller went away (disconnect / cancellation): free the scheduler's slots.
                self.abort_request(state.rid)

    def _make_output(self, st: ReqState, index: int) -> dict[str, Any]:
        now = time.time()
        meta: dict[str, Any] = {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens,
            "cached_tokens": st.cached_tokens,
            "finish_reason": st.finished_reason,
            "e2e_latency": now - st.created_time,
        }
        if st.spec_verify_ct > 0:
            # SGLang 0.5.23's meanings: the accept length counts the bonus (and the prefill) token, the
            # accept rate is the strict share of proposed drafts that were accepted.
            meta["spec_verify_ct"] = st.spec_verify_ct
            meta["spec_accept_length"] = st.completion_tokens / st.spec_verify_ct
            meta["spec_num_correct_drafts"] = st.spec_num_correct_drafts
            meta["spec_num_proposed_drafts"] = st.spec_num_proposed_drafts
            if st.spec_num_proposed_drafts:
                meta["spec_accept_rate"] = st.spec_num_correct_drafts / st.spec_num_proposed_drafts
        if st.spec_cap_length is not None:
            meta["spec_cap_length"] = st.spec_cap_length
        if st.output_token_logprobs is not None:
            # SGLang's shapes: [logprob, token_id, token_text] (text only with return_text_in_logprobs), and
            # per output token a list of such entries for its top alternatives.
            text = self._token_text if st.return_text_in_logprobs else _no_text
            meta["output_token_logprobs"] = [
                [lp, tid, text(tid)] for lp, tid in zip(st.output_token_logprobs, st.output_ids)
            ]
            if st.output_top_logprobs is not None:
                meta["output_top_logprobs"] = [
                    [[lp, tid, text(tid)] for tid, lp in zip(ids, lps)] for ids, lps in st.output_top_logprobs
                ]
            if st.input_token_logprobs is not None:
                lps, tops = st.input_token_logprobs
                prompt_ids = st.input_ids[st.logprob_start_len :]
                meta["input_token_logprobs"] = [[lp, tid, text(tid)] for lp, tid in zip(lps, prompt_ids)]
                meta["input_top_logprobs"] = [
                    None if top is None else [[lp, tid, text(tid)] for tid, lp in zip(*top)] for top in tops
                ]
        out = {
            "text": st.text,
            "output_ids": list(st.output_ids),
            "meta_info": meta,
            "index": index,
            "delta_text": st.delta_text,
            "delta_output_ids": st.delta_ids,
        }
        st.delta_text, st.delta_ids = "", []
        return out

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def abort_request(self, rid: str) -> bool:
        """Abort rid: forget it here and tell the scheduler to free its slots (no-op if unknown)."""
        state = self.rid_to_state.pop(rid, None)
        self.send_to_scheduler.send_pyobj(AbortReq(rid=rid))
        if state is not None and not state.finished:
            self.num_aborted += 1
            state.finished_reason = finish_abort(AbortReq.message)
            if self.on_request_finished is not None:  # metrics count it as an aborted request
                self.on_request_finished(state)
            state.event.set()  # a caller still waiting (/abort_request from elsewhere) gets the abort
            return True
        return False

    # ------------------------------------------------------------------ receive loop
    def _ensure_running(self) -> None:
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        if self._handle_task is None or self._handle_task.done() or self._loop is not loop:
            if self._handle_task is not None and self._handle_task.done() and not self._handle_task.cancelled():
                exc = self._handle_task.exception()
                if exc is not None:
                    raise EngineDeadError(f"the receive loop failed: {exc!r}") from exc
            self._loop = loop
            self._handle_task = loop.create_task(self._handle_loop())

    def _raise_if_dead(self) -> None:
        if self.dead_reason is None:
            reason = self.check_children()
            if reason is not None:
                self.fail_all(reason)
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def check_children(self) -> Optional[str]:
        """A message naming the dead subprocesses (the likely cause first), or None while all are alive.

        Ranks that share collectives die together (a peer's death breaks the next all-gather), so a
        process killed by a signal is named first: it is the cause, the others are its casualties.
        """
        dead = [(name, proc) for name, proc in self.child_processes if not proc.is_alive()]
        if not dead:
            return None
        dead.sort(key=lambda item: not (item[1].exitcode is not None and item[1].exitcode < 0))
        name, proc = dead[0]
        reason = f"the {name} process (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}"
        if len(dead) > 1:
            reason += " (also exited: " + ", ".join(f"{n} with code {p.exitcode}" for n, p in dead[1:]) + ")"
        return reason + "; the server cannot serve requests any more (see that process's log above)"

    async def watch_children(self, on_dead: Callable[[str], None], interval_s: float = 1.0) -> None:
        """Poll the subprocesses; when one dies fail every request and call on_dead(reason)."""
        while self.dead_reason is None:
            await asyncio.sleep(interval_s)
            reason = self.check_children()
            if reason is not None:
                self.fail_all(reason)
        on_dead(self.dead_reason)

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_detokenizer.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                self._handle_batch_str_out(msg)
            elif type(msg) in self._control_waiters:
                waiters = self._control_waiters[type(msg)]
                while waiters:
                    fut = waiters.popleft()
                    if not fut.done():
                        fut.set_result(msg)
                        break
            else:
                logger.error("TokenizerManager got an unexpected message %r", type(msg).__name__)

    def _handle_batch_str_out(self, out: BatchStrOut) -> None:
        now = time.time()
        for i, rid in enumerate(out.rids):
            st = self.rid_to_state.get(rid)
            if st is None:
                continue  # aborted here already
            st.text += out.output_strs[i]
            st.delta_text += out.output_strs[i]
            st.output_ids.extend(out.output_ids[i])
            st.delta_ids.extend(out.output_ids[i])
            if out.output_ids[i] and st.first_token_time is None:
                st.first_token_time = now
            st.completion_tokens = out.completion_tokens[i]
            st.cached_tokens = out.cached_tokens[i]
            st.spec_verify_ct = out.spec_verify_ct[i]
            if out.spec_cap_length is not None and out.spec_cap_length[i] is not None:
                st.spec_cap_length = out.spec_cap_length[i]
            if out.spec_num_correct_drafts is not None:
                st.spec_num_correct_drafts = out.spec_num_correct_drafts[i]
                st.spec_num_proposed_drafts = out.spec_num_proposed_drafts[i]
            if out.input_token_logprobs is not None and out.input_token_logprobs[i] is not None:
                st.input_token_logprobs = out.input_token_logprobs[i]
            if out.output_top_logprobs is not None and out.output_top_logprobs[i] is not None:
                st.output_top_logprobs = (st.output_top_logprobs or []) + list(out.output_top_logprobs[i])
            if out.output_token_logprobs is not None and out.output_token_logprobs[i] is not None:
                st.output_token_logprobs = (st.output_token_logprobs or []) + list(out.output_token_logprobs[i])
            reason = out.finished_reasons[i]
            if reason is not None:
                st.finished_reason = reason
                del self.rid_to_state[rid]
                self.num_finished += 1
                if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
                    # The detokenizer may have seen the stop string before the scheduler did; an abort
                    # of a request the scheduler already finished is a no-op there.
                    self.send_to_scheduler.send_pyobj(AbortReq(rid=rid, message="stop string"))
                elif reason.get("type") == "abort":  # a detokenizer fault: free its KV (no-op if the scheduler ended it)
                    self.send_to_scheduler.send_pyobj(AbortReq(rid=rid, message=str(reason.get("message"))))
                if self.on_request_finished is not None:
                    self.on_request_finished(st)
            st.event.set()

    # ------------------------------------------------------------------ control requests
    async def _control(self, req: Any, reply_type: type, timeout: float) -> Any:
        self._ensure_running()
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters[reply_type].append(fut)
        self.send_to_scheduler.send_pyobj(req)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                self._raise_if_dead()
                if time.monotonic() >= deadline:
                    fut.cancel()
                    raise TimeoutError(f"the scheduler did not answer {type(req).__name__} within {timeout:.0f} s")

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheReqOutput:
        """Ask the scheduler to drop its prefix cache."""
        return await self._control(FlushCacheReq(), FlushCacheReqOutput, timeout)

    async def get_internal_state(self, timeout: float = 30.0) -> dict[str, Any]:
        """The scheduler's live state (free KV slots, accept length, ...)."""
        out = await self._control(GetInternalStateReq(), GetInternalStateReqOutput, timeout)
        return out.internal_state

    async def health_check(self, timeout: float = 20.0) -> bool:
        """A round trip through the scheduler loop."""
        await self._control(HealthCheckReq(), HealthCheckOutput, timeout)
        return True

    def fail_all(self, reason: str) -> None:
        """Mark the engine dead and wake every waiting request (they raise EngineDeadError)."""
        if self.dead_reason is None:
            logger.error("%s", reason)
        self.dead_reason = reason
        for st in list(self.rid_to_state.values()):
            st.event.set()
        for waiters in self._control_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(EngineDeadError(reason))

    def close(self) -> None:
        """Close the sockets."""
        if self._handle_task is not None and not self._handle_task.done():
            self._handle_task.cancel()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.context.destroy(linger=0)


def _no_text(token_id: int) -> None:
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def scheduler_info_dict(info: SchedulerReady) -> dict[str, Any]:
    """SchedulerReady as a plain dict (for /get_server_info)."""
    return dataclasses.asdict(info)
