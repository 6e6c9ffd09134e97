"""The HTTP front end over a scheduler test double: OpenAI client, SSE, validation, auth, aborts, metrics.

The expected text is always transformers' decode of the token ids the scheduler produced (the double's
rule is a fixed function of the last two tokens), so these tests check the front end's plumbing, not a model.
"""

import asyncio
import json

import httpx
import openai
import pytest

from fake_scheduler import CONTEXT_LEN, TOTAL_SLOTS, fake_next_token
from sglite.testing.bad_requests import malformed_requests

SUITE = "unit-cpu"
EST_TIME = 70

pytestmark = pytest.mark.timeout(180)


def expected_ids(prompt_ids, n):
    seq = list(prompt_ids)
    out = []
    for _ in range(n):
        t = fake_next_token(seq)
        seq.append(t)
        out.append(t)
    return out


def chat_prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base + "/v1", api_key=fake_server.api_key, max_retries=0)


def free_slots(server):
    info = httpx.get(server.base + "/get_server_info", headers=server.headers, timeout=10).json()
    return info["internal_states"][0]["available_kv_slots"]


def test_models_and_info(fake_server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    info = httpx.get(fake_server.base + "/server_info", headers=fake_server.headers).json()
    assert info["api_key"] == "***" and info["max_total_num_tokens"] == TOTAL_SLOTS
    assert info["context_length"] == CONTEXT_LEN  # what the server enforces, not the unset flag
    mi = httpx.get(fake_server.base + "/get_model_info", headers=fake_server.headers).json()
    assert mi["context_length"] == CONTEXT_LEN and mi["is_generation"] is True
    assert httpx.get(fake_server.base + "/model_info", headers=fake_server.headers).json() == mi


def test_chat_non_stream_text_and_usage(fake_server, client, tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7)
    prompt = chat_prompt_ids(tokenizer, messages)
    ids = expected_ids(prompt, 7)
    assert r.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 7, len(prompt) + 7)


def test_chat_stream_matches_non_stream(fake_server, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café 🙂"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_raw_sse_ends_with_done(fake_server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", fake_server.base + "/v1/completions", json=body, headers=fake_server.headers) as r:
        lines = [l for l in r.iter_lines() if l]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(l.startswith("data: ") for l in lines)


def test_completions_stop_string_trims_and_counts(fake_server, client, tokenizer):
    prompt = "The quick brown"
    pids = tokenizer.encode(prompt)
    ids = expected_ids(pids, 40)
    full = tokenizer.decode(ids)
    # Pick a stop string from the middle of the reference continuation.
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip() and "\ufffd" not in stop
    k = next(k for k in range(1, 41) if stop in tokenizer.decode(ids[:k]))
    want = tokenizer.decode(ids[:k])
    want = want[: want.find(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=[stop])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, stop=stop, stream=True) if c.choices)
    assert streamed == want


def test_completions_token_ids_and_batch(fake_server, client, tokenizer):
    r = client.completions.create(model="tiny", prompt=[[10, 11, 12], [40, 41]], max_tokens=5)
    assert len(r.choices) == 2
    for ch, p in zip(sorted(r.choices, key=lambda c: c.index), [[10, 11, 12], [40, 41]]):
        assert ch.text == tokenizer.decode(expected_ids(p, 5))
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 10


def test_generate_native_single_batch_and_stream(fake_server, tokenizer):
    h = fake_server.headers
    r = httpx.post(fake_server.base + "/generate", headers=h, json={
        "input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "log_metrics": True,
    }).json()
    assert r["output_ids"] == expected_ids([7, 8, 9], 6)
    assert r["text"] == tokenizer.decode(r["output_ids"])
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert r["meta_info"]["prompt_tokens"] == 3 and r["meta_info"]["completion_tokens"] == 6
    batch = httpx.post(fake_server.base + "/generate", headers=h, json={
        "text": ["hello", "world"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}],
    }).json()
    assert [len(b["output_ids"]) for b in batch] == [2, 3]
    with httpx.stream("POST", fake_server.base + "/generate", headers=h, json={
        "input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 6}, "stream": True}) as s:
        events = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: ") and l != "data: [DONE]"]
    assert events[-1]["output_ids"] == r["output_ids"] and events[-1]["text"] == r["text"]


def test_unknown_fields_are_ignored(fake_server, client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x", "extra": 1}], "max_tokens": 2,
            "no_stop_trim": False, "separate_reasoning": True, "return_hidden_states": False, "top_k": 5,
            "chat_template_kwargs": {}, "return_meta_info": True}
    r = httpx.post(fake_server.base + "/v1/chat/completions", json=body, headers=fake_server.headers)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


def test_malformed_requests_get_400_and_server_still_works(fake_server, client, tokenizer):
    bad = malformed_requests("tiny", CONTEXT_LEN)
    assert len(bad) >= 30
    with httpx.Client(base_url=fake_server.base, headers=fake_server.headers, timeout=30) as http:
        for b in bad:
            r = http.post(b.path, content=b.content(), headers={"content-type": b.content_type})
            assert r.status_code == 400, (b.name, r.status_code, r.text)
            body = r.json()
            assert body["object"] == "error" and body["code"] == 400 and body["message"], (b.name, body)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=CONTEXT_LEN)
    r = client.completions.create(model="tiny", prompt=[3, 4], max_tokens=4)
    assert r.choices[0].text == tokenizer.decode(expected_ids([3, 4], 4))
    assert free_slots(fake_server) == TOTAL_SLOTS


def test_api_key_required_except_public_routes(fake_server):
    base = fake_server.base
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": fake_server.api_key}).status_code == 401
    r = httpx.post(base + "/generate", json={"text": "a"})
    assert r.status_code == 401 and r.json()["type"] == "AuthenticationError"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


def test_cancelled_streams_free_their_slots(fake_server, tokenizer):
    initial = free_slots(fake_server)

    async def one(i, http, cancel):
        body = {"model": "tiny", "prompt": [20 + i, 30], "max_tokens": 60, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                n += 1
                if cancel and n == 3:
                    return None  # leaving the context manager closes the connection mid-stream
        return text

    async def main():
        async with httpx.AsyncClient(base_url=fake_server.base, headers=fake_server.headers, timeout=60) as http:
            return await asyncio.gather(*(one(i, http, i % 4 == 0) for i in range(32)))

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 4:
            assert text == tokenizer.decode(expected_ids([20 + i, 30], 60))
    for _ in range(50):
        if free_slots(fake_server) == initial:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert free_slots(fake_server) == initial


def test_non_stream_disconnect_aborts(fake_server):
    initial = free_slots(fake_server)
    body = {"model": "tiny", "prompt": [9, 9], "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.base + "/v1/completions", json=body, headers=fake_server.headers, timeout=0.3)
    for _ in range(50):
        if free_slots(fake_server) == initial:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert free_slots(fake_server) == initial


def test_metrics_count_requests(fake_server, client):
    client.completions.create(model="tiny", prompt="m", max_tokens=2)
    text = httpx.get(fake_server.base + "/metrics").text
    assert 'sglite:generation_tokens_total{model_name="tiny"}' in text
    assert "sglite:time_to_first_token_seconds_bucket" in text
    assert "sglite:token_usage" in text


def test_a_trailing_slash_is_a_404_never_a_redirect_built_from_the_host_header(fake_server):
    r = httpx.post(fake_server.base + "/v1/chat/completions/", headers={**fake_server.headers, "Host": "evil.example"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "location" not in r.headers


def test_flush_cache_and_abort_routes(fake_server):
    h = fake_server.headers
    assert httpx.post(fake_server.base + "/flush_cache", headers=h).json()["success"] is True
    assert httpx.post(fake_server.base + "/abort_request", json={"rid": "nope"}, headers=h).status_code == 200
    assert httpx.get(fake_server.base + "/health_generate", headers=h).status_code == 200


def test_children_exit_when_the_server_is_killed(fake_server):
    """Last: SIGKILL the HTTP process (no cleanup runs); the scheduler and detokenizer must not be orphaned."""
    import os
    import signal
    import time

    pids = httpx.get(fake_server.base + "/get_server_info", headers=fake_server.headers).json()["process_pids"]
    assert set(pids) == {"scheduler rank 0", "detokenizer"}
    os.kill(fake_server.proc.pid, signal.SIGKILL)
    fake_server.proc.wait(10)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.2)
    assert not any(alive(p) for p in pids.values()), pids
