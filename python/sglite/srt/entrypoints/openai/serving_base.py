"""Shared request pipeline of the OpenAI endpoints: parse -> validate -> convert -> respond.

Every failure a client can cause becomes HTTP 400 with the OpenAI-style error body; a dead engine is
503. Streams are SSE (``data: {...}`` lines, then ``data: [DONE]``); a stream whose client goes away
aborts its requests, and a non-streaming request races the handler against the client's disconnect.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from sglite.srt.entrypoints.openai.protocol import REFUSED_ERROR, error_body
from sglite.srt.entrypoints.request_limits import JSONLimitError, loads_limited
from sglite.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglite.srt.managers.tokenizer_manager import EngineDeadError, RequestValidationError, TokenizerManager

logger = logging.getLogger(__name__)

# HTTP status nginx uses for "client closed request"; the client never sees it.
STATUS_CLIENT_CLOSED = 499
# Bodies above this size are parsed off the event loop.
OFF_LOOP_JSON_BYTES = 256 * 1024
# Prompts in one batched request: more would queue ahead of every other client's request at once.
MAX_BATCH_PROMPTS = 1024


def error_response(message: str, *, param: Optional[str] = None, status: int = 400, err_type: str = "BadRequestError") -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(error_body(message, err_type=err_type, param=param, code=status), status_code=status)


def abort_error_response(metas: list[dict[str, Any]]) -> Optional[JSONResponse]:
    """The error response of a request aborted by a server-side failure (finish reason with a status_code)."""
    for meta in metas:
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            code = int(reason["status_code"])
            if code == 503:  # shed load (a full queue): the client may retry, and is told when
                response = error_response(str(reason.get("message", "aborted")), status=503,
                                          err_type="ServiceUnavailableError")
                response.headers["Retry-After"] = RETRY_AFTER_S
                return response
            return error_response(str(reason.get("message", "aborted")), status=code,
                                  err_type="InternalServerError" if code >= 500 else "BadRequestError")
    return None


# Seconds a client told "queue full" waits before retrying (a decode step is milliseconds; a queue drains in seconds).
RETRY_AFTER_S = "1"


def validation_error_message(e: ValidationError) -> tuple[str, Optional[str]]:
    """One readable line (and the offending field) from a pydantic ValidationError.

    A union field fails once per branch; the branch tags (``list[int]``, ``SamplingParamsRequest``)
    are dropped from the path and repeated lines are reported once."""
    errors = e.errors()
    for err in errors:
        if err["type"] == REFUSED_ERROR:  # an option this server does not implement: say only that
            return str(err["msg"]), str(err["ctx"]["name"])
    first: dict[tuple[Any, ...], str] = {}  # path -> message of its first error
    for err in errors:
        path = tuple(x for x in err.get("loc", ()) if isinstance(x, int) or _FIELD_NAME.fullmatch(str(x)))
        first.setdefault(path, str(err.get("msg")))
    # A branch that failed at the top of a field ("not a list") says less than one that failed inside it.
    paths = [p for p in first if not any(q[: len(p)] == p and q != p for q in first)]
    parts = [f"{'.'.join(map(str, p))}: {first[p]}" if p else first[p] for p in paths[:3]]
    param = next((str(p[0]) for p in paths if p), None)
    return "invalid request: " + "; ".join(parts), param


# A request field name; union branch tags (str, list[int], SomeModel, function-after[...]) are not.
_FIELD_NAME = re.compile(r"(?!(?:str|int|float|bool|list|dict|none)$)[a-z_][a-z0-9_]*")


async def read_json_body(request: Request) -> Union[dict[str, Any], JSONResponse]:
    """The request body as a JSON object within the shape limits, or a 400 response saying why it is not one."""
    content_type = request.headers.get("content-type", "")
    if content_type and "json" not in content_type.lower():
        return error_response(f"unsupported content type {content_type!r}; send application/json")
    raw = await request.body()
    try:
        # A large body is parsed and checked in a thread so the event loop keeps serving others.
        body = await asyncio.to_thread(loads_limited, raw) if len(raw) > OFF_LOOP_JSON_BYTES else loads_limited(raw)
    except JSONLimitError as e:
        return error_response(f"the request body is refused: {e}", param=e.param)
    except ValueError as e:
        return error_response(f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return error_response(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_model(model_cls: type[BaseModel], body: dict[str, Any]) -> Union[BaseModel, JSONResponse]:
    """Validate body into model_cls, or a 400 response naming the bad field."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        message, param = validation_error_message(e)
        return error_response(message, param=param)


async def read_request_model(request: Request, model_cls: type[BaseModel]) -> Union[BaseModel, JSONResponse]:
    """The JSON body validated into model_cls, or the 400 response saying why it is not one."""
    body = await read_json_body(request)
    if isinstance(body, Response):
        return body
    return parse_model(model_cls, body)


def check_batch_size(obj: GenerateReqInput, param: str) -> None:
    """Raise RequestValidationError when a request holds more than MAX_BATCH_PROMPTS prompts, or asks for more
    than MAX_BATCH_PROMPTS sequences in all (prompts x n): one request may not occupy the server for everyone."""
    if obj.is_batch and obj.batch_size > MAX_BATCH_PROMPTS:
        raise RequestValidationError(
            f"the request holds {obj.batch_size} prompts; at most {MAX_BATCH_PROMPTS} are allowed in one request", param
        )
    sequences = requested_sequences(obj)
    if sequences > MAX_BATCH_PROMPTS:
        raise RequestValidationError(
            f"the request asks for {sequences} sequences (prompts x n); at most {MAX_BATCH_PROMPTS} are allowed in "
            "one request", "n",
        )


def requested_sequences(obj: GenerateReqInput) -> int:
    """Prompts times their ``n`` (a wrong-typed n counts as 1 here: SamplingParams.verify refuses it by name)."""

    def n_of(params: object) -> int:
        n = params.get("n", 1) if isinstance(params, dict) else 1
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    prompts = obj.batch_size if obj.is_batch else 1
    if isinstance(obj.sampling_params, list):
        return sum(n_of(p) for p in obj.sampling_params)
    return prompts * n_of(obj.sampling_params)


async def run_until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run work, cancelling it if the client disconnects first (its generators then abort)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=STATUS_CLIENT_CLOSED)


def sse(data: Union[dict[str, Any], str]) -> str:
    """One server-sent event line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


class OpenAIServingBase(abc.ABC):
    """validate -> convert -> respond, shared by chat and completions."""

    request_model: type[BaseModel]
    prompt_param = "prompt"  # the request field a prompt-length error points at

    def __init__(self, tokenizer_manager: TokenizerManager, served_model_name: str) -> None:
        self.tm = tokenizer_manager
        self.served_model_name = served_model_name

    @abc.abstractmethod
    def convert(self, req: Any) -> GenerateReqInput:
        """Build the engine request (raise RequestValidationError for bad content)."""

    async def prepare(self, req: Any) -> GenerateReqInput:
        """The engine request, built off the event loop (convert may tokenize or render a template)."""
        return await self.tm.run_off_loop(self.convert, req)

    @abc.abstractmethod
    async def respond_full(self, req: Any, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> Response:
        """Non-streaming response."""

    @abc.abstractmethod
    def stream_chunks(self, req: Any, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> AsyncIterator[str]:
        """SSE lines of a streaming response (without the final [DONE])."""

    # Shared pipeline.
    async def handle(self, request: Request) -> Response:
        """Parse, validate and answer one HTTP request."""
        req = await read_request_model(request, self.request_model)
        if isinstance(req, Response):
            return req
        # Any model name is served, as SGLang's chat and completions do (clients send "default").
        try:
            self.check_unsupported(req)
            obj = await self.prepare(req)
            check_batch_size(obj, self.prompt_param)
            tokenized = await self.tm.run_off_loop(self.tm.tokenize_request, obj, fill_context=True)
        except RequestValidationError as e:
            param = self.prompt_param if e.param == "prompt" else _openai_param(e.param)
            return error_response(str(e), param=param)
        except EngineDeadError as e:
            return error_response(str(e), status=503, err_type="ServiceUnavailableError")
        if req.stream:
            return StreamingResponse(self._sse(req, obj, tokenized), media_type="text/event-stream")
        return await run_until_disconnect(request, self._full(req, obj, tokenized))

    async def _full(self, req: Any, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> Response:
        try:
            return await self.respond_full(req, obj, tokenized)
        except EngineDeadError as e:
            return error_response(str(e), status=503, err_type="ServiceUnavailableError")

    async def _sse(self, req: Any, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> AsyncIterator[str]:
        try:
            async for line in self.stream_chunks(req, obj, tokenized):
                yield line
        except EngineDeadError as e:
            yield sse({"error": error_body(str(e), err_type="ServiceUnavailableError", code=503)})
        finally:
            # Whatever ended the stream (disconnect, cancellation), no request may keep its slots.
            for t in tokenized:
                if t.rid in self.tm.rid_to_state:
                    self.tm.abort_request(t.rid)
        yield sse("[DONE]")

    def check_unsupported(self, req: Any) -> None:
        """Reject options this server does not implement (instead of silently ignoring them); per endpoint."""

    def sampling_params(self, req: Any, max_new_tokens: Optional[int]) -> dict[str, Any]:
        """The SamplingParams dict of an OpenAI request (None values mean 'server default')."""
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "skip_special_tokens": req.skip_special_tokens,
            "seed": req.seed,
            "n": req.n,
            "frequency_penalty": req.frequency_penalty,
            "presence_penalty": req.presence_penalty,
            "repetition_penalty": req.repetition_penalty,
            "min_new_tokens": req.min_tokens,
            "logit_bias": req.logit_bias,
        }

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """OpenAI usage object (with cached prompt tokens)."""
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    async def full_response(
        self, req: Any, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput], object_name: str,
        id_prefix: str, choice: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> Response:
        """The non-streaming body: every choice (``choice(output)``, ordered by index), usage, optional meta_info."""
        finals = sorted([o async for o in self.tm.generate_request(obj, tokenized)], key=lambda o: o["index"])
        metas = [o["meta_info"] for o in finals]
        failed = abort_error_response(metas)
        if failed is not None:
            return failed
        body: dict[str, Any] = {
            "id": self.new_id(id_prefix),
            "object": object_name,
            "created": self.now(),
            "model": self.served_model_name,
            "choices": [{
                "index": out["index"], **choice(out),
                "finish_reason": finish_reason_str(out["meta_info"]["finish_reason"]),
                "matched_stop": out["meta_info"]["finish_reason"].get("matched"),
            } for out in finals],
            "usage": self.total_usage(metas, req.n),
        }
        if req.return_meta_info:
            body["meta_info"] = metas[0] if len(metas) == 1 else metas
        return JSONResponse(body)

    @staticmethod
    def meta_usage(meta: dict[str, Any]) -> dict[str, Any]:
        """The usage object of one request's meta_info."""
        return OpenAIServingBase.usage(meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])

    @staticmethod
    def total_usage(metas: list[dict[str, Any]], n: int) -> dict[str, Any]:
        """Usage over choices ordered by index, n per prompt: each prompt counted once, every completion."""
        prompts = metas[::n]
        return OpenAIServingBase.usage(
            sum(m["prompt_tokens"] for m in prompts),
            sum(m["completion_tokens"] for m in metas),
            sum(m["cached_tokens"] for m in prompts),
        )

    def token_logprobs(
        self, meta: dict[str, Any], start: int = 0, key: str = "output"
    ) -> list[tuple[str, Optional[float], list[tuple[str, float]]]]:
        """(token text, logprob, [(text, logprob) of its top alternatives]) per output (or ``key="input"``:
        prompt) token from ``start``; the first prompt token has a None logprob and no alternatives."""
        entries = meta.get(f"{key}_token_logprobs") or []
        tops = meta.get(f"{key}_top_logprobs") or [[] for _ in entries]
        decode = self.tm.tokenizer.decode
        return [
            (decode([tid]), None if lp is None else float(lp), [(decode([t]), float(v)) for v, t, _ in top or []])
            for (lp, tid, _), top in zip(entries[start:], tops[start:])
        ]

    @staticmethod
    def new_id(prefix: str) -> str:
        """A response id."""
        return f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def now() -> int:
        """Unix seconds."""
        return int(time.time())


def finish_reason_str(reason: Optional[dict[str, Any]]) -> Optional[str]:
    """OpenAI finish_reason from ours: stop | length | abort."""
    if reason is None:
        return None
    return str(reason.get("type"))


def _openai_param(param: Optional[str]) -> Optional[str]:
    return {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "top_logprobs"}.get(param or "", param)

