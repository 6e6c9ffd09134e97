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
    param: Optional[str] = None  # the field the error must name (checked when set)

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
        BadRequest("n 0", chat, body=c(n=0)),
        BadRequest("frequency_penalty above 2", chat, body=c(frequency_penalty=3.0)),
        BadRequest("repetition_penalty 0", comp, body=p(repetition_penalty=0)),
        BadRequest("min_tokens above max_tokens", chat, body=c(min_tokens=10)),
        BadRequest("logit_bias key not a token id", chat, body=c(logit_bias={"hello": 1.0})),
        BadRequest("logit_bias token outside the vocabulary", comp, body=p(logit_bias={str(10**9): 1.0})),
        BadRequest("logit_bias value above 100", chat, body=c(logit_bias={"1": 500})),
        BadRequest("top_logprobs 21", chat, body=c(logprobs=True, top_logprobs=21)),
        BadRequest("top_logprobs without logprobs", chat, body=c(top_logprobs=2)),
        BadRequest("completions logprobs 21", comp, body=p(logprobs=21)),
        BadRequest("generate top_logprobs_num 21", gen, body={"text": "a", "return_logprob": True, "top_logprobs_num": 21}),
        BadRequest("generate logprob_start_len past the prompt", gen, body={"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}),
        BadRequest("generate logprob_start_len below -1", gen, body={"text": "a", "logprob_start_len": -2}),
        BadRequest("tokenize prompt and messages", "/tokenize", body={"prompt": "a", "messages": msgs}),
        BadRequest("tokenize nothing", "/v1/tokenize", body={}),
        BadRequest("detokenize out of vocabulary", "/detokenize", body={"tokens": [10**9]}),
        BadRequest("detokenize strings", "/v1/detokenize", body={"tokens": ["a"]}),
        BadRequest("chat reasoning_effort", chat, body=c(reasoning_effort="high"), param="reasoning_effort"),
        BadRequest("seed string", comp, body=p(seed="abc")),
        BadRequest("stream wrong type", chat, body=c(stream=[1])),
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
        BadRequest("completions 16 prompts x n 128", comp, body=p(prompt=["a"] * 16, n=128)),
        BadRequest("generate 2 prompts x n 1000 in one sampling_params", gen,
                   body={"text": ["a", "b"], "sampling_params": {"n": 1000, "max_new_tokens": 2}}),
        BadRequest("stop strings of 64 x 1k characters", comp, body=p(stop=["x" * 1024] * 64)),
        BadRequest("generate spaces_between_special_tokens string", gen,
                   body={"text": "a", "sampling_params": {"spaces_between_special_tokens": "x"}}),
        BadRequest("assistant tool_calls in the history", chat, body=c(messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])),
        BadRequest("generate max_new_tokens 0", gen, body={"text": "a", "sampling_params": {"max_new_tokens": 0}}),
        BadRequest("generate negative temperature", gen, body={"text": "a", "sampling_params": {"temperature": -1}}),
        BadRequest("generate batch rid mismatch", gen, body={"text": ["a", "b"], "rid": ["only-one"]}),
        BadRequest("generate not json", gen, raw="{oops"),
        BadRequest("abort without rid", "/abort_request", body={}),
        *hostile_requests(model),
    ]


def hostile_requests(model: str) -> list[BadRequest]:
    """What a hostile client sent (issue 14): coercible types, invalid Unicode, deep or huge JSON, unserved options."""
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    gen = "/generate"

    def c(**kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **kw}

    def p(**kw: Any) -> dict[str, Any]:
        return {"model": model, "prompt": "hello", "max_tokens": 4, **kw}

    def g(**sp: Any) -> dict[str, Any]:
        return {"text": "hello", "sampling_params": {"max_new_tokens": 4, **sp}}

    def with_raw(body: dict[str, Any], key: str, raw_value: str) -> str:
        # json.dumps cannot write these values (a 5000-digit literal, 100k brackets): splice them in.
        return json.dumps({**body, key: 0}).replace(f'"{key}": 0', f'"{key}": {raw_value}')

    lone = "\\ud800"  # a lone high surrogate, as JSON writes it
    deep = "[" * 100_000 + "]" * 100_000
    return [
        # No coercion: bool is not an int, a string is not a bool, an int is not a bool.
        BadRequest("max_tokens true", chat, body=c(max_tokens=True), param="max_tokens"),
        BadRequest("stream 'yes'", chat, body=c(stream="yes"), param="stream"),
        BadRequest("stream 1", comp, body=p(stream=1), param="stream"),
        BadRequest("temperature true", comp, body=p(temperature=True), param="temperature"),
        BadRequest("n true", chat, body=c(n=True), param="n"),
        BadRequest("logprobs 'yes'", chat, body=c(logprobs="yes"), param="logprobs"),
        BadRequest("ignore_eos 'true'", comp, body=p(ignore_eos="true"), param="ignore_eos"),
        BadRequest("seed 1.5", chat, body=c(seed=1.5), param="seed"),
        BadRequest("max_tokens 10.0", comp, body=p(max_tokens=10.0), param="max_tokens"),
        BadRequest("prompt token ids as bools", comp, body=p(prompt=[True, False]), param="prompt"),
        BadRequest("stream_options.include_usage 'yes'", chat, body=c(stream=True, stream_options={"include_usage": "yes"}), param="stream_options"),
        BadRequest("generate input_ids bools", gen, body={"input_ids": [True, False]}, param="input_ids"),
        BadRequest("generate skip_special_tokens 'no'", gen, body=g(skip_special_tokens="no"), param="sampling_params"),
        BadRequest("generate max_new_tokens true", gen, body=g(max_new_tokens=True), param="sampling_params"),
        BadRequest("generate stream 'yes'", gen, body={"text": "a", "stream": "yes"}, param="stream"),
        BadRequest("generate bootstrap_port true", gen, body={"text": "a", "bootstrap_port": True}, param="bootstrap_port"),
        BadRequest("abort abort_all 'yes'", "/abort_request", body={"abort_all": "yes"}, param="abort_all"),
        BadRequest("abort rid number", "/abort_request", body={"rid": 5}, param="rid"),
        # Invalid Unicode: a lone UTF-16 surrogate anywhere.
        BadRequest("lone surrogate in prompt", comp, raw=json.dumps(p(prompt="x")).replace('"x"', f'"a{lone}b"'), param="prompt"),
        BadRequest("lone surrogate in chat content", chat, raw=json.dumps(c()).replace('"hello"', f'"{lone}"'), param="messages"),
        BadRequest("lone surrogate in stop", chat, raw=json.dumps(c(stop=["x"])).replace('["x"]', f'["{lone}"]'), param="stop"),
        BadRequest("lone surrogate in generate text", gen, raw=json.dumps({"text": "x"}).replace('"x"', f'"{lone}"'), param="text"),
        BadRequest("lone surrogate in a key", comp, raw='{"' + lone + '": 1, ' + json.dumps(p())[1:]),
        # JSON Python's parser chokes on: 100k-deep nesting, a 5000-digit integer; and out-of-range numbers.
        BadRequest("100k-deep nested JSON body", chat, raw=deep),
        BadRequest("100k-deep nested JSON field", chat, raw=with_raw(c(), "chat_template_kwargs", deep)),
        BadRequest("5000-digit integer", comp, raw=with_raw(p(), "max_tokens", "9" * 5000)),
        BadRequest("4000-digit integer", comp, raw=with_raw(p(), "seed", "9" * 4000), param="seed"),
        BadRequest("2**64 seed", chat, body=c(seed=2**64), param="seed"),
        BadRequest("1e999 temperature", comp, raw=with_raw(p(), "temperature", "1e999"), param="temperature"),
        BadRequest("generate huge token id", gen, raw=with_raw({"sampling_params": {"max_new_tokens": 2}}, "input_ids", "[" + "1" * 30 + "]"), param="input_ids"),
        # Options this server does not implement are refused by name, never ignored.
        BadRequest("chat functions", chat, body=c(functions=[{"name": "f", "parameters": {}}]), param="functions"),
        BadRequest("chat regex", chat, body=c(regex="a+"), param="regex"),
        BadRequest("completions json_schema", comp, body=p(json_schema="{}"), param="json_schema"),
        BadRequest("completions lora_path", comp, body=p(lora_path="adapter"), param="lora_path"),
        BadRequest("generate sampling_params.regex", gen, body=g(regex="a+"), param="regex"),
        BadRequest("generate image_data", gen, body={"text": "a", "image_data": "http://x/y.png"}, param="image_data"),
        BadRequest("chat response_format json_object", chat, body=c(response_format={"type": "json_object"}), param="response_format"),
        BadRequest("chat tool_choice required", chat, body=c(tool_choice="required"), param="tool_choice"),
        BadRequest("chat tools", chat, body=c(tools=[{"type": "function", "function": {"name": "f"}}]), param="tools"),
        BadRequest("chat_template in request (untrusted)", chat, body=c(chat_template="{{ 'x' }}"), param="chat_template"),
        BadRequest("chat_template kwarg (untrusted)", chat, body=c(chat_template_kwargs={"chat_template": "{{ 'x' }}"}), param="chat_template_kwargs"),
        BadRequest("chat_template_kwargs.tokenize", chat, body=c(chat_template_kwargs={"tokenize": True}), param="chat_template_kwargs"),
        # Ranges the request models check themselves (the sampling ranges are SamplingParams.verify's).
        BadRequest("completions logprobs -1", comp, body=p(logprobs=-1), param="logprobs"),
        BadRequest("chat top_logprobs -1", chat, body=c(logprobs=True, top_logprobs=-1), param="top_logprobs"),
        BadRequest("bootstrap_port 70000", chat, body=c(bootstrap_port=70000), param="bootstrap_port"),
        # List lengths.
        BadRequest("65 stop strings", comp, body=p(stop=[f"s{i}" for i in range(65)]), param="stop"),
        BadRequest("2000-prompt completions batch", comp, body=p(prompt=[[5]] * 2000), param="prompt"),
        BadRequest("2000-prompt generate batch", gen, body={"input_ids": [[5]] * 2000}, param="input_ids"),
    ]
