"""Request limits: JSON shape checks, and over HTTP the hostile bodies of issue 14 (10 MB, chunked, half-open,
client chat templates) against a server whose scheduler is the test double. Each hostile request runs
while a normal request is timed: no client may be frozen by another."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from fake_scheduler import TOTAL_SLOTS
from sglite.srt.entrypoints.request_limits import (
    MAX_JSON_DEPTH,
    JSONLimitError,
    check_json_shape,
    default_max_request_body_bytes,
    loads_limited,
)

SUITE = "unit-cpu"
EST_TIME = 55

pytestmark = pytest.mark.timeout(240)

BODY_TIMEOUT_S = 2
LOOPING_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
)


# ------------------------------------------------------------------ JSON shape (no server)
def test_loads_limited_accepts_ordinary_bodies():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "héllo 🙂"}]}],
            "seed": 2**63 - 1, "temperature": 0.5, "input_ids": list(range(1000))}
    assert loads_limited(json.dumps(body).encode()) == body


@pytest.mark.parametrize(
    "raw, param",
    [
        ("[" * 100_000 + "]" * 100_000, None),  # json raises RecursionError
        ('{"a": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}", "a"),  # parses; too deep
        ('{"seed": ' + "9" * 5000 + "}", None),  # json raises ValueError (4300-digit cap)
        ('{"seed": ' + str(2**64) + "}", "seed"),
        ('{"t": 1e999}', "t"),
        ('{"t": NaN}', None),
        ('{"t": -Infinity}', None),
        ('{"prompt": "a\\ud800b"}', "prompt"),
        ('{"stop": ["ok", "\\udfff"]}', "stop"),
        ('{"\\ud800": 1}', None),
        ('"\\ud800"', None),
    ],
)
def test_loads_limited_refuses(raw, param):
    with pytest.raises(ValueError) as info:
        loads_limited(raw.encode())
    if isinstance(info.value, JSONLimitError):
        assert info.value.param == param
        assert "\ud800" not in str(info.value) and "\udfff" not in str(info.value)


def test_check_json_shape_is_iterative():
    node: list = []
    deep = node
    for _ in range(50_000):  # deeper than the interpreter's recursion limit
        node.append([])
        node = node[0]
    with pytest.raises(JSONLimitError):
        check_json_shape(deep)


def test_default_body_limit_fits_the_context():
    assert default_max_request_body_bytes(256) == 1 << 20
    assert default_max_request_body_bytes(131072) == 64 * 131072


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server(make_fake_server):
    return make_fake_server("--trust-request-chat-template", "--request-body-timeout", str(BODY_TIMEOUT_S))


def _normal_request(base: str, headers: dict) -> float:
    """Seconds a small completion takes."""
    t = time.monotonic()
    r = httpx.post(base + "/v1/completions", headers=headers, timeout=30,
                   json={"model": "tiny", "prompt": [3, 4], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return time.monotonic() - t


async def _timed_beside(server, hostile) -> tuple:
    """Run hostile() and, once it is under way, a normal request; (hostile's result, normal latency)."""
    task = asyncio.create_task(asyncio.to_thread(hostile))
    await asyncio.sleep(0.3)
    latency = await asyncio.to_thread(_normal_request, server.base, server.headers)
    return await task, latency


def test_10mb_prompt_is_413_and_does_not_freeze_others(server):
    body = json.dumps({"model": "tiny", "prompt": "x " * 5_000_000, "max_tokens": 2}).encode()

    def hostile():
        t = time.monotonic()
        try:
            r = httpx.post(server.base + "/v1/completions", content=body, timeout=60,
                           headers={**server.headers, "content-type": "application/json"})
        except httpx.TransportError as e:  # the server may close before the client finished writing
            return None, type(e).__name__, time.monotonic() - t
        return r.status_code, r.json(), time.monotonic() - t

    (status, err, seconds), latency = asyncio.run(_timed_beside(server, hostile))
    assert latency < 5.0
    assert seconds < 5.0
    if status is not None:
        assert status == 413 and err["code"] == 413 and "--max-request-body-bytes" in err["message"]


def test_huge_prompt_under_the_limit_is_tokenized_off_the_event_loop(server):
    # ~900 KB of text: within the 1 MiB limit, seconds of tokenization, then a 400 (longer than the context).
    body = {"model": "tiny", "prompt": "ab " * 300_000, "max_tokens": 2}

    def hostile():
        t = time.monotonic()
        r = httpx.post(server.base + "/v1/completions", json=body, headers=server.headers, timeout=120)
        return r.status_code, r.json(), time.monotonic() - t

    (status, err, seconds), latency = asyncio.run(_timed_beside(server, hostile))
    assert status == 400 and err["param"] == "prompt" and "context length" in err["message"], err
    assert latency < 5.0
    # The normal request was answered while the huge one was still being tokenized.
    assert latency < seconds - 0.3, (latency, seconds)


def test_chunked_body_is_cut_off_at_the_limit(server):
    sent = 0

    def chunks():
        nonlocal sent
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(64):  # 16 MiB if the server read it all
            sent += 1
            yield b"x" * (256 * 1024)
        yield b'"}'

    try:
        r = httpx.post(server.base + "/v1/completions", content=chunks(), timeout=30,
                       headers={**server.headers, "content-type": "application/json"})
        assert r.status_code == 413, r.text
    except httpx.TransportError:
        pass  # closed mid-upload after the 413
    assert sent < 64
    assert _normal_request(server.base, server.headers) < 5.0


def _half_open(server, path="/generate") -> tuple[bytes, float]:
    """Send headers promising 1000 bytes and only 10 of them; what the server answers, and when."""
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=BODY_TIMEOUT_S + 20) as s:
        auth = f"Authorization: Bearer {server.api_key}\r\n".encode()
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                  + b"Content-Length: 1000\r\n\r\n{\"text\": \"")
        answer = b""
        while chunk := s.recv(4096):  # the server closes the connection after its answer
            answer += chunk
    return answer, time.monotonic() - t


def test_half_open_body_times_out_with_408(server):
    (answer, seconds), latency = asyncio.run(_timed_beside(server, lambda: _half_open(server)))
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert BODY_TIMEOUT_S - 0.5 < seconds < BODY_TIMEOUT_S + 5
    assert b"did not arrive" in answer
    assert latency < 5.0


def test_client_template_renders_when_trusted(server, tokenizer):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}{{ extra }}"
    messages = [{"role": "user", "content": "hi there"}]
    want = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True, extra="!")
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 1, "chat_template": template,
        "chat_template_kwargs": {"extra": "!"}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(want, add_special_tokens=False))


def test_looping_template_is_stopped_and_does_not_freeze_others(server):
    def hostile():
        t = time.monotonic()
        r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": LOOPING_TEMPLATE}})
        return r.status_code, r.json(), time.monotonic() - t

    (status, err, seconds), latency = asyncio.run(_timed_beside(server, hostile))
    assert status == 400 and err["param"] == "chat_template" and "did not render within" in err["message"], err
    assert seconds < 15.0
    assert latency < 5.0
    # The worker was replaced: the next client template renders.
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "chat_template": "{{ 'ok' }}"})
    assert r.status_code == 200, r.text


def test_server_healthy_and_slots_free_after_hostile_requests(server):
    assert httpx.get(server.base + "/health").status_code == 200
    info = httpx.get(server.base + "/get_server_info", headers=server.headers, timeout=10).json()
    assert info["internal_states"][0]["available_kv_slots"] == TOTAL_SLOTS


def test_openapi_declares_request_models(server):
    schema = httpx.get(server.base + "/openapi.json", headers=server.headers).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    models = schema["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "GenerateRequest", "AbortRequest", "SamplingParamsRequest"} <= set(models)
    assert models["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["type"] == "integer"
