"""bench_serving against a real local HTTP server that streams like sglite's /generate and /v1/completions."""

import asyncio
import json
import socket
import threading
import time

import pytest

SUITE = "unit-cpu"
EST_TIME = 8

uvicorn = pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")

from sglite.bench_serving import (  # noqa: E402
    _stats_ms,
    compare_results,
    format_result,
    make_random_requests,
    run_benchmark,
)

TOKENS_PER_REQ = 5
VERIFY_STEPS = 2  # pretend speculation: 5 tokens in 2 verify steps


def _make_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]

        async def gen():
            for i in range(1, n + 1):
                await asyncio.sleep(0.002)
                meta = {"completion_tokens": i, "spec_verify_ct": VERIFY_STEPS if i == n else 1}
                yield f"data: {json.dumps({'text': 'x' * i, 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = body["max_tokens"]

        async def gen():
            for i in range(n):
                await asyncio.sleep(0.002)
                # Text only on the last step, as a random model's partial UTF-8 bytes stream from vLLM.
                yield f"data: {json.dumps({'choices': [{'text': 'y' if i == n - 1 else ''}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_make_app(), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(timeout=5)


def test_stats_ms_percentiles():
    st = _stats_ms([0.001 * i for i in range(1, 101)])
    assert st["mean"] == pytest.approx(50.5)
    assert st["median"] == pytest.approx(50.5)
    assert st["p99"] == pytest.approx(99.01)


def test_random_requests_lengths_within_range():
    reqs = make_random_requests(50, 100, 20, 0.5, 512, seed=3)
    assert all(50 <= r.prompt_len <= 100 and 10 <= r.output_len <= 20 for r in reqs)
    assert all(len(r.prompt_ids) == r.prompt_len and min(r.prompt_ids) >= 8 for r in reqs)
    assert make_random_requests(50, 100, 20, 0.5, 512, seed=3)[0].prompt_ids == reqs[0].prompt_ids


@pytest.mark.timeout(60)
def test_native_backend_counts_tokens_and_accept_length(server_url):
    reqs = make_random_requests(8, 16, TOKENS_PER_REQ, 1.0, 512, seed=0)
    res = asyncio.run(run_benchmark(server_url, reqs, "sglite", max_concurrency=4, show_progress=False))
    assert res.completed == 8 and res.failed == 0
    assert res.total_output_tokens == 8 * TOKENS_PER_REQ
    assert res.total_input_tokens == 8 * 16
    assert res.accept_length == pytest.approx(TOKENS_PER_REQ / VERIFY_STEPS)
    assert res.ttft_ms["mean"] > 0 and res.itl_ms["mean"] > 0 and res.tpot_ms["mean"] > 0
    assert "Accept length" in format_result(res)


@pytest.mark.timeout(60)
def test_openai_backend_reads_usage(server_url):
    reqs = make_random_requests(4, 10, 3, 1.0, 512, seed=1)
    res = asyncio.run(run_benchmark(server_url, reqs, "openai", "m", request_rate=100.0, show_progress=False))
    assert res.completed == 4
    assert res.total_output_tokens == 12
    assert res.accept_length is None
    # Every step's chunk times a token, text or not: 1 TTFT and 2 ITL samples per request.
    assert res.ttft_ms["median"] > 0 and res.itl_ms["median"] > 0
    assert res.ttft_ms["median"] < res.e2e_ms["median"]


@pytest.mark.timeout(60)
def test_compare_results_ratios(server_url):
    reqs = make_random_requests(4, 8, 3, 1.0, 512, seed=2)
    a = asyncio.run(run_benchmark(server_url, reqs, "sglite", max_concurrency=2, show_progress=False))
    b = asyncio.run(run_benchmark(server_url, reqs, "sglite", max_concurrency=1, show_progress=False))
    r = compare_results(a, b)
    assert r["output_throughput"] == pytest.approx(a.output_throughput / b.output_throughput)
    assert r["mean_e2e"] == pytest.approx(a.e2e_ms["mean"] / b.e2e_ms["mean"])
    assert set(r) == {"output_throughput", "request_throughput", "mean_ttft", "mean_tpot", "mean_e2e"}
