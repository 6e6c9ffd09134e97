"""Limits on what one client may send, enforced before any request model sees it.

- Body size: a Content-Length above the limit is answered 413 before a byte is read; a chunked body
  is counted while it streams in and cut off at the limit (nothing past it is buffered).
- Body time: the whole body must arrive within a deadline, else 408 (a half-open or trickling upload
  holds no handler forever).
- JSON shape: nesting depth, integers beyond 64 bits, NaN / Infinity and lone UTF-16 surrogates are
  refused with a reason; Python's json raises RecursionError / ValueError on the first two, which
  would otherwise surface as a 500.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglite.srt.entrypoints.openai.protocol import error_body

# Every request body the server defines nests far less deeply (chat content parts: 5 levels).
MAX_JSON_DEPTH = 32
# Token ids, seeds and ports all fit in 64 bits; anything larger is a mistake or an attack.
MAX_INT_BITS = 64
# The smallest default body limit, and the per-token allowance above it: a JSON-escaped token of text
# (``\uXXXX`` is 6 bytes a character) or a token id with its separator fits in 64 bytes.
MIN_DEFAULT_BODY_BYTES = 1 << 20
BODY_BYTES_PER_CONTEXT_TOKEN = 64


class RequestBodyError(Exception):
    """A body the server will not read to the end: ``status`` is 413 (too large) or 408 (too slow)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class JSONLimitError(ValueError):
    """A JSON body that parses but breaks a limit; ``param`` is the top-level field it is under."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def default_max_request_body_bytes(context_len: int) -> int:
    """The body limit when --max-request-body-bytes is not given: room for a full context, at least 1 MiB."""
    return max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * int(context_len))


@dataclass
class RequestBodyLimits:
    """What RequestBodyLimitMiddleware enforces."""

    max_bytes: int
    timeout_s: float


class RequestBodyLimitMiddleware:
    """Pure-ASGI guard of request bodies: 413 above ``max_bytes``, 408 after ``timeout_s``.

    An over-long Content-Length is answered here; otherwise the wrapped ``receive`` raises
    RequestBodyError while the handler reads, and the app's exception handler answers it. After the
    last body chunk ``receive`` is passed through untouched (handlers wait on it for a disconnect).
    """

    def __init__(self, app: ASGIApp, limits: RequestBodyLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await body_error_response(RequestBodyError(_too_large_message(int(value), limit), 413))(
                    scope, receive, send
                )
                return
        loop = asyncio.get_running_loop()
        received = 0
        done = False
        deadline: float | None = None

        async def limited_receive() -> Message:
            nonlocal received, done, deadline
            if done:
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.limits.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise RequestBodyError(
                    f"the request body did not arrive within {self.limits.timeout_s:g} s", 408
                ) from None
            if message["type"] != "http.request":
                done = True
                return message
            received += len(message.get("body", b""))
            if received > limit:
                raise RequestBodyError(_too_large_message(received, limit, at_least=True), 413)
            done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)


def body_error_response(e: RequestBodyError) -> JSONResponse:
    """The OpenAI-style answer to a body that was not read; the connection closes (its rest is unread)."""
    err_type = "RequestTooLargeError" if e.status == 413 else "RequestTimeoutError"
    return JSONResponse(
        error_body(str(e), err_type=err_type, code=e.status), status_code=e.status, headers={"connection": "close"}
    )


def _too_large_message(size: int, limit: int, *, at_least: bool = False) -> str:
    got = f"more than {limit}" if at_least else str(size)
    return (
        f"the request body is {got} bytes; this server accepts at most {limit} "
        "(--max-request-body-bytes)"
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_limited(raw: bytes) -> Any:
    """json.loads with the shape limits; raises ValueError (JSONLimitError for a parsed body) saying why."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise JSONLimitError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", None) from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, or Python's 4300-digit cap on int literals
        if "integer string conversion" in str(e):
            raise JSONLimitError(f"an integer does not fit in {MAX_INT_BITS} bits", None) from None
        raise
    check_json_shape(value)
    return value


def check_json_shape(value: Any) -> None:
    """Raise JSONLimitError for too-deep nesting, a >64-bit integer, a non-finite float or a lone surrogate."""
    # Iterative, so a deep document cannot exhaust the stack; scalars in lists are checked inline
    # (a prompt of token ids is one long list).
    if not isinstance(value, (dict, list)):
        _check_scalar(value, None)
        return
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)]
    while stack:
        node, depth, top = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise JSONLimitError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", top)
        if isinstance(node, dict):
            items = node.items()
        else:
            items = enumerate(node)
        for key, child in items:
            if isinstance(key, str):
                _check_scalar(key, top)  # before the key can name a field in a message
            field = top if top is not None else (key if isinstance(key, str) else None)
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, field))
            else:
                _check_scalar(child, field)


def _check_scalar(x: Any, field: str | None) -> None:
    where = f" in '{field}'" if field else ""
    if isinstance(x, str):
        if not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise JSONLimitError(f"a string{where} contains a lone UTF-16 surrogate (invalid Unicode)", field) from None
    elif isinstance(x, bool) or x is None:
        return
    elif isinstance(x, int):
        if x.bit_length() > MAX_INT_BITS:
            raise JSONLimitError(f"an integer{where} does not fit in {MAX_INT_BITS} bits", field)
    elif isinstance(x, float) and not math.isfinite(x):
        raise JSONLimitError(f"a number{where} is not finite", field)
