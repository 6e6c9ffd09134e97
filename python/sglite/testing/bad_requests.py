"""A catalogue of malformed requests, each of which a server must answer with HTTP 400 (for tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class BadRequest:
    """One malformed request: where to send it and what makes it bad."""

    name: str
    path: str
    body: Optional[Any] = None  # JSON-serialisable body
    raw: Optional[str] = None  # raw body text, sent as-is
    content_type: str = "application/json"

    def content(self) -> bytes:
        """The bytes to send."""
        return (self.raw if self.raw is not None else json.dumps(self.body)).encode()


def malformed_requests(model: str, context_len: int) -> list[BadRequest]:
    """Requests that are each wrong in exactly one way."""
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    gen = "/generate"
    msgs = [{"role": "user", "content": "hello"}]

    def c(**kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": msgs, "max_tokens": 4, **kw}

    def p(**kw: Any) -> dict[str, Any]:
        return {"model": model, "prompt": "hello", "max_tokens": 4, **kw}

    long_prompt = [5] * (context_len + 8)
    return [
        BadRequest("not json", chat, raw="this is not json"),
        BadRequest("truncated json", chat, raw='{"model": "x", "messages": ['),
        BadRequest("json array body", chat, body=[1, 2, 3]),
        BadRequest("json string body", comp, body="hello"),
        BadRequest("wrong content type", chat, raw=json.dumps(c()), content_type="text/plain"),
        BadRequest("missing messages", chat, body={"model": model, "max_tokens": 4}),
        BadRequest("empty messages", chat, body=c(messages=[])),
        BadRequest("messages not a list", chat, body=c(messages="hello")),
        BadRequest("bad role", chat, body=c(messages=[{"role": "wizard", "content": "hi"}])),
        BadRequest("image content part", chat, body=c(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
        BadRequest("missing model", chat, body={"messages": msgs, "max_tokens": 4}),
        BadRequest("unknown model", chat, body=c(model="no-such-model")),
        BadRequest("max_tokens 0", chat, body=c(max_tokens=0)),
        BadRequest("max_tokens negative", comp, body=p(max_tokens=-5)),
        BadRequest("max_tokens string", chat, body=c(max_tokens="ten")),
        BadRequest("max_completion_tokens 0", chat, body=c(max_completion_tokens=0)),
        BadRequest("negative temperature", chat, body=c(temperature=-0.5)),
        BadRequest("string temperature", comp, body=p(temperature="hot")),
        BadRequest("NaN temperature", chat, raw=json.dumps(c()).replace('"max_tokens": 4', '"max_tokens": 4, "temperature": NaN')),
        BadRequest("infinite temperature", comp, raw=json.dumps(p()).replace('"max_tokens": 4', '"max_tokens": 4, "temperature": Infinity')),
        BadRequest("top_p 0", chat, body=c(top_p=0)),
        BadRequest("top_p above 1", comp, body=p(top_p=1.5)),
        BadRequest("top_k below -1", chat, body=c(top_k=-2)),
        BadRequest("top_k 0", comp, body=p(top_k=0)),
        BadRequest("min_p above 1", chat, body=c(min_p=2.0)),
        BadRequest("empty stop string", chat, body=c(stop=[""])),
        BadRequest("stop wrong type", comp, body=p(stop=5)),
        BadRequest("stop_token_ids strings", chat, body=c(stop_token_ids=["a"])),
        BadRequest("n 2", chat, body=c(n=2)),
        BadRequest("seed string", comp, body=p(seed="abc")),
        BadRequest("stream wrong type", chat, body=c(stream=[1])),
        BadRequest("unsupported frequency_penalty", chat, body=c(frequency_penalty=1.0)),
        BadRequest("prompt longer than context", comp, body=p(prompt=long_prompt)),
        BadRequest("prompt + max_tokens over context", comp, body=p(max_tokens=context_len)),
        BadRequest("chat max_tokens over context", chat, body=c(max_tokens=context_len + 1)),
        BadRequest("empty prompt list", comp, body=p(prompt=[])),
        BadRequest("prompt wrong type", comp, body=p(prompt={"text": "x"})),
        BadRequest("prompt empty token list", comp, body=p(prompt=[[]])),
        BadRequest("generate without input", gen, body={"sampling_params": {"max_new_tokens": 2}}),
        BadRequest("generate text and input_ids", gen, body={"text": "a", "input_ids": [1, 2]}),
        BadRequest("generate token out of vocab", gen, body={"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}}),
        BadRequest("generate negative token", gen, body={"input_ids": [-1], "sampling_params": {"max_new_tokens": 2}}),
        BadRequest("generate sampling_params string", gen, body={"text": "a", "sampling_params": "hot"}),
        BadRequest("generate max_new_tokens 0", gen, body={"text": "a", "sampling_params": {"max_new_tokens": 0}}),
        BadRequest("generate negative temperature", gen, body={"text": "a", "sampling_params": {"temperature": -1}}),
        BadRequest("generate batch rid mismatch", gen, body={"text": ["a", "b"], "rid": ["only-one"]}),
        BadRequest("generate not json", gen, raw="{oops"),
        BadRequest("abort without rid", "/abort_request", body={}),
        BadRequest("chat top_logprobs (unsupported)", chat, body=c(logprobs=True, top_logprobs=2)),
        BadRequest("completions top logprobs (unsupported)", comp, body=p(logprobs=2)),
    ]
