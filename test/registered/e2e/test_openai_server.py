"""A real server on a tiny Qwen3: the official openai client, /generate == Engine == transformers greedy,
400s for malformed requests, cancelled streams giving their KV slots back, prefix-cache hits, API key,
and a dead scheduler taking the server down with a clear message (last test of the module)."""

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
import torch

from conftest import API_KEY, CHILD_ENV, ServerProcess
from sglite.testing.bad_requests import malformed_requests
from sglite.testing.greedy_margin import assert_clear_greedy_margins

SUITE = "e2e-cpu"
EST_TIME = 150

pytestmark = pytest.mark.timeout(300)
EOS = 2


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server_log") / "server.log")
    srv = ServerProcess(tiny_model_dir, log, "--enable-metrics")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def hf_greedy(hf_model, prompt_ids, max_new_tokens):
    """transformers greedy continuation (stops after EOS, which it includes)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=EOS, pad_token_id=EOS,
        )
    gen = out[0, len(prompt_ids):].tolist()
    gen = gen[: gen.index(EOS) + 1] if EOS in gen else gen
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(hf_model, [prompt_ids], [gen])
    return gen


def chat_ids(tok, messages):
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def state(server):
    info = httpx.get(server.base + "/get_server_info", headers=server.headers, timeout=30).json()
    return info["internal_states"][0]


def flush_and_free_slots(server):
    """Free slots after flushing the prefix cache (refused while requests still run, so retry)."""
    for _ in range(100):
        r = httpx.post(server.base + "/flush_cache", headers=server.headers, timeout=30)
        if r.status_code == 200:
            return state(server)["available_kv_slots"]
        time.sleep(0.1)
    raise AssertionError(f"flush_cache kept failing: {r.text}")


def test_health_models_and_info(server, client):
    assert httpx.get(server.base + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    info = httpx.get(server.base + "/server_info", headers=server.headers).json()
    st = info["internal_states"][0]
    assert st["available_kv_slots"] == st["initial_free_slots"] > 0
    assert "avg_spec_accept_length" in st and info["memory_plan"]["max_total_num_tokens"] == info["max_total_num_tokens"]
    assert info["memory_plan_per_rank"] == [info["memory_plan"]]  # tp 1: one rank
    assert httpx.get(server.base + "/health_generate", headers=server.headers, timeout=60).status_code == 200


def test_chat_greedy_equals_transformers(server, client, hf_model, hf_tokenizer):
    messages = [{"role": "user", "content": "Write one line of Python."}]
    ref = hf_greedy(hf_model, chat_ids(hf_tokenizer, messages), 12)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == hf_tokenizer.decode(ref, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ref)
    assert r.usage.prompt_tokens == len(chat_ids(hf_tokenizer, messages))
    assert r.choices[0].finish_reason == ("stop" if ref[-1] == EOS else "length")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(ref) and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_completions_max_tokens_and_stop(server, client, hf_model, hf_tokenizer):
    prompt = "def main():"
    pids = hf_tokenizer.encode(prompt)
    ref = hf_greedy(hf_model, pids, 24)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].text == hf_tokenizer.decode(ref[:5], skip_special_tokens=True)
    assert r.usage.completion_tokens == min(5, len(ref))
    text = hf_tokenizer.decode(ref, skip_special_tokens=True)
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    want = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True) if c.choices)
        else:
            res = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
            got = res.choices[0].text
            assert res.choices[0].finish_reason == "stop"
        assert got == want


def test_generate_equals_transformers_greedy(server, hf_model, hf_tokenizer, tmp_path_factory):
    prompts = [[11, 12, 13, 14], [200, 7], hf_tokenizer.encode("import os\n")]
    refs = [hf_greedy(hf_model, p, 16) for p in prompts]
    r = httpx.post(server.base + "/generate", headers=server.headers, timeout=120, json={
        "input_ids": prompts, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["output_ids"] for o in outs] == refs
    for o, ref in zip(outs, refs):
        assert o["text"] == hf_tokenizer.decode(ref, skip_special_tokens=True)
        assert o["meta_info"]["completion_tokens"] == len(ref)
    pytest.generate_outputs = [o["output_ids"] for o in outs]  # compared with the Engine below
    pytest.generate_prompts = prompts


def hf_token_logprobs(hf_model, prompt_ids, output_ids):
    """transformers' log_softmax of the logits at each output token (teacher-forced)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logp[torch.arange(len(output_ids)), torch.tensor(output_ids)].tolist()


def test_logprobs_equal_transformers(server, client, hf_model, hf_tokenizer):
    prompt = [11, 12, 13, 14]
    r = httpx.post(server.base + "/generate", headers=server.headers, timeout=120, json={
        "input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"] and all(e[2] is None for e in entries)
    ref = hf_token_logprobs(hf_model, prompt, out["output_ids"])
    assert [e[0] for e in entries] == pytest.approx(ref, abs=1e-3)

    res = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    ids = out["output_ids"][:6]
    assert res.choices[0].logprobs.token_logprobs == pytest.approx(ref[: len(ids)], abs=1e-3)
    assert res.choices[0].logprobs.tokens == [hf_tokenizer.decode([t]) for t in ids]
    tokens = res.choices[0].logprobs.tokens
    assert res.choices[0].logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0, stream=True) if c.choices and c.choices[0].logprobs]
    assert [lp for chunk in streamed for lp in chunk.token_logprobs] == pytest.approx(ref[: len(ids)], abs=1e-3)
    assert [o for chunk in streamed for o in chunk.text_offset] == res.choices[0].logprobs.text_offset

    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True)
    chat_ids_out = hf_greedy(hf_model, chat_ids(hf_tokenizer, messages), 6)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [hf_tokenizer.decode([t]) for t in chat_ids_out]
    assert [c.logprob for c in content] == pytest.approx(
        hf_token_logprobs(hf_model, chat_ids(hf_tokenizer, messages), chat_ids_out), abs=1e-3)


def test_prefix_cache_hit_keeps_tokens(server, hf_model):
    shared = list(range(40, 80))
    a = shared + [90, 91]
    b = shared + [95, 96, 97]
    flush_and_free_slots(server)
    first = httpx.post(server.base + "/generate", headers=server.headers, timeout=60,
                       json={"input_ids": a, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    second = httpx.post(server.base + "/generate", headers=server.headers, timeout=60,
                        json={"input_ids": b, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= len(shared) - 1 > 0
    assert second["output_ids"] == hf_greedy(hf_model, b, 8)
    assert first["output_ids"] == hf_greedy(hf_model, a, 8)


def test_malformed_requests_then_still_correct(server, client, hf_model):
    ctx = httpx.get(server.base + "/get_model_info", headers=server.headers).json()["context_length"]
    bad = malformed_requests("tiny", ctx)
    assert len(bad) >= 30
    with httpx.Client(base_url=server.base, headers=server.headers, timeout=30) as http:
        for b in bad:
            r = http.post(b.path, content=b.content(), headers={"content-type": b.content_type})
            assert r.status_code == 400, (b.name, r.status_code, r.text)
            body = r.json()
            assert body["object"] == "error" and body["code"] == 400 and body["message"], (b.name, body)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=ctx)
    r = client.completions.create(model="tiny", prompt=[31, 32, 33], max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    out = httpx.post(server.base + "/generate", headers=server.headers, timeout=60,
                     json={"input_ids": [31, 32, 33], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert out["output_ids"] == hf_greedy(hf_model, [31, 32, 33], 6)


def test_64_streams_16_cancelled_slots_return(server, hf_model):
    initial = flush_and_free_slots(server)
    assert initial == state(server)["initial_free_slots"]
    aborted_before = httpx.get(server.base + "/get_server_info", headers=server.headers).json()["front_end"]["num_aborted"]
    prompts = [[100 + i, 3 + i % 7, 50] for i in range(64)]
    cancel = {i for i in range(64) if i % 4 == 0}

    async def one(http, i):
        body = {"input_ids": prompts[i], "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                "stream": True}
        last = None
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = json.loads(line[6:])
                n += 1
                if i in cancel and n == 2:
                    return None  # closes the connection mid-stream
        return last

    async def run_all():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base, headers=server.headers, timeout=240, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    results = asyncio.run(run_all())
    done = [i for i in range(64) if i not in cancel]
    for i in done:
        assert results[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert len(results[i]["output_ids"]) == 24
    # Spot-check a few completed streams against transformers (all would be slow on 2 cores).
    with torch.no_grad():
        for i in done[:4]:
            ref = hf_model.generate(torch.tensor([prompts[i]]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=EOS)[0, 3:].tolist()
            assert_clear_greedy_margins(hf_model, [prompts[i]], [ref])  # exact equality needs no near-ties (greedy_margin)
            assert results[i]["output_ids"] == ref
    assert flush_and_free_slots(server) == initial
    front = httpx.get(server.base + "/get_server_info", headers=server.headers).json()["front_end"]
    assert front["num_aborted"] - aborted_before == len(cancel)  # they really were cut off mid-stream
    assert front["num_tracked_reqs"] == 0


def test_api_key(server):
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200
    assert httpx.get(server.base + "/v1/models").status_code == 401
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": "x"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics(server):
    text = httpx.get(server.base + "/metrics").text
    assert "sglite:generation_tokens_total" in text and "sglite:e2e_request_latency_seconds_bucket" in text
    assert 'sglite:num_running_reqs{model_name="tiny"}' in text


def test_engine_equals_generate(tiny_model_dir):
    """sglite.Engine on the same checkpoint gives /generate's tokens (hence transformers')."""
    if not hasattr(pytest, "generate_outputs"):
        pytest.skip("needs test_generate_equals_transformers_greedy to have run")
    import sglite

    os.environ.update(CHILD_ENV)
    engine = sglite.Engine(model_path=tiny_model_dir, device="cpu", cpu_kv_cache_budget_mb=4)
    try:
        outs = engine.generate(input_ids=pytest.generate_prompts, sampling_params={"max_new_tokens": 16, "temperature": 0})
        assert [o["output_ids"] for o in outs] == pytest.generate_outputs
        streamed = [c["output_ids"] for c in engine.generate_stream(input_ids=pytest.generate_prompts[0],
                                                                   sampling_params={"max_new_tokens": 16, "temperature": 0})]
        assert sum(streamed, []) == pytest.generate_outputs[0]
        st = engine.get_server_info()["internal_states"][0]
        assert st["num_running_reqs"] == 0
    finally:
        engine.shutdown()


def test_behind_sglang_router(server, hf_model, hf_tokenizer, tmp_path):
    """sglang-router (which re-serializes bodies and adds fields) in front of the server."""
    pytest.importorskip("sglang_router")
    import subprocess
    import sys

    from conftest import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", server.base, "--policy", "round_robin", "--api-key", API_KEY,
         # Its metrics exporter defaults to port 29000: another router on the box would collide.
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        rc = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Write one line of Python."}]
        deadline = time.monotonic() + 60
        while True:
            try:
                r = rc.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
                break
            except (openai.APIConnectionError, openai.InternalServerError, openai.NotFoundError):
                if time.monotonic() > deadline or router.poll() is not None:
                    log.flush()
                    raise AssertionError("router not serving:\n" + (tmp_path / "router.log").read_text()[-3000:])
                time.sleep(0.5)
        ref = hf_greedy(hf_model, chat_ids(hf_tokenizer, messages), 12)
        assert r.choices[0].message.content == hf_tokenizer.decode(ref, skip_special_tokens=True)
        streamed = "".join(c.choices[0].text for c in rc.completions.create(
            model="tiny", prompt="def main():", max_tokens=6, temperature=0, stream=True) if c.choices)
        pids = hf_tokenizer.encode("def main():")
        assert streamed == hf_tokenizer.decode(hf_greedy(hf_model, pids, 6), skip_special_tokens=True)
        g = httpx.post(base + "/generate", headers=server.headers, timeout=60, json={
            "input_ids": [31, 32, 33], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        assert g["output_ids"] == hf_greedy(hf_model, [31, 32, 33], 6)
        with pytest.raises(openai.BadRequestError):
            rc.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=-1)
    finally:
        router.terminate()
        router.wait(10)
        log.close()


def test_dead_scheduler_fails_health_and_exits(server):
    """Last: kill the scheduler; /health turns 503 and the server exits non-zero, naming the process."""
    pids = httpx.get(server.base + "/get_server_info", headers=server.headers).json()["process_pids"]
    os.kill(pids["scheduler rank 0"], signal.SIGKILL)
    server.watch_health_until_exit(30)
    assert server.proc.wait(30) == 1
    out = server.output()
    assert "scheduler rank 0" in out and "exited unexpectedly" in out
    for pid in pids.values():  # no orphans
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
            time.sleep(0.2)
        else:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
