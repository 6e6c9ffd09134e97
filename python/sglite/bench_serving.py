"""Online serving benchmark: an OpenAI-API / native load generator with SGLang bench_serving's metrics.

Definitions (as SGLang's bench_serving):
- TTFT: request sent → first content chunk. ITL: gaps between consecutive content chunks.
- TPOT: (E2E - TTFT) / (output_tokens - 1), per request with more than one output token.
- Throughput: completed requests (and tokens) / benchmark wall time.
- Accept length (speculative): completion tokens / verify steps, summed over requests (native backend).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx


@dataclass
class BenchRequest:
    """One prompt to send: token ids (random dataset) or text (file dataset)."""

    prompt_ids: Optional[list[int]]
    prompt_text: Optional[str]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What one request measured."""

    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    spec_verify_ct: int = 0
    error: str = ""


@dataclass
class BenchResult:
    """Aggregate metrics of one run (JSON-serialisable)."""

    backend: str
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    accept_length: Optional[float]
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    max_concurrency: Optional[int]
    request_rate: float


def _stats_ms(values: list[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": 1000 * sum(xs) / len(xs), "median": 1000 * pct(0.5), "p99": 1000 * pct(0.99)}


def make_random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """Random token-id prompts with lengths uniform in [len*ratio, len] (SGLang's random dataset)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        # Avoid the lowest ids: small trained vocabularies keep special tokens there.
        ids = [rng.randint(8, vocab_size - 1) for _ in range(n_in)]
        reqs.append(BenchRequest(ids, None, n_in, n_out))
    return reqs


def load_file_requests(path: str, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """Prompts from a JSONL file with a "prompt" field (and optional "output_len")."""
    reqs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            text = row["prompt"]
            reqs.append(BenchRequest(None, text, len(text.split()), int(row.get("output_len", output_len))))
            if len(reqs) >= num_prompts:
                break
    if not reqs:
        raise ValueError(f"--dataset-path {path!r} holds no prompts")
    return reqs


async def _sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _send(client: httpx.AsyncClient, base_url: str, backend: str, req: BenchRequest, model: str) -> RequestResult:
    """Send one streaming request and time its chunks."""
    prompt: Any = req.prompt_ids if req.prompt_ids is not None else req.prompt_text
    if backend == "sglite":
        url = f"{base_url}/generate"
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
        body["input_ids" if req.prompt_ids is not None else "text"] = prompt
    else:
        url = f"{base_url}/v1/completions"
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    res = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for event in _sse_events(resp):
                now = time.perf_counter()
                if backend == "sglite":
                    meta = event.get("meta_info", {})
                    res.output_len = int(meta.get("completion_tokens", res.output_len))
                    res.spec_verify_ct = int(meta.get("spec_verify_ct", 0) or 0)
                    has_content = bool(event.get("text")) or res.output_len > 0
                else:
                    usage = event.get("usage")
                    if usage:
                        res.output_len = int(usage.get("completion_tokens", res.output_len))
                        res.prompt_len = int(usage.get("prompt_tokens", res.prompt_len))
                    choices = event.get("choices") or []
                    # Every choice chunk is a token step (vLLM and sglite stream one per step, text or not);
                    # counting only chunks with text loses the steps whose bytes are still partial UTF-8.
                    has_content = bool(choices)
                if has_content:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    backend: str = "sglite",
    model: str = "default",
    max_concurrency: Optional[int] = None,
    request_rate: float = float("inf"),
    seed: int = 0,
    show_progress: bool = True,
) -> BenchResult:
    """Send every request (Poisson arrivals at request_rate, at most max_concurrency in flight)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", disable=not show_progress)
    except ImportError:  # tqdm is a dependency; keep the benchmark usable without it anyway
        bar = None

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def one(r: BenchRequest) -> None:
            if sem is None:
                results.append(await _send(client, base_url, backend, r, model))
            else:
                async with sem:
                    results.append(await _send(client, base_url, backend, r, model))
            if bar is not None:
                bar.update(1)

        start = time.perf_counter()
        tasks = []
        for r in requests:
            tasks.append(asyncio.create_task(one(r)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()

    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    verify = sum(r.spec_verify_ct for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return BenchResult(
        backend=backend,
        num_prompts=len(requests),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        accept_length=(total_out / verify) if verify else None,
        ttft_ms=_stats_ms([r.ttft for r in ok]),
        tpot_ms=_stats_ms(tpots),
        itl_ms=_stats_ms([x for r in ok for x in r.itl]),
        e2e_ms=_stats_ms([r.e2e for r in ok]),
        max_concurrency=max_concurrency,
        request_rate=request_rate,
    )


def format_result(res: BenchResult) -> str:
    """A readable table in SGLang's layout."""
    rows = [
        ("Backend", res.backend),
        ("Successful requests", res.completed),
        ("Failed requests", res.failed),
        ("Max concurrency", res.max_concurrency or "unbounded"),
        ("Benchmark duration (s)", f"{res.duration_s:.2f}"),
        ("Total input tokens", res.total_input_tokens),
        ("Total generated tokens", res.total_output_tokens),
        ("Request throughput (req/s)", f"{res.request_throughput:.2f}"),
        ("Input token throughput (tok/s)", f"{res.input_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{res.output_throughput:.2f}"),
        ("Accept length", f"{res.accept_length:.2f}" if res.accept_length else "n/a"),
    ]
    for name, st in (("TTFT", res.ttft_ms), ("TPOT", res.tpot_ms), ("ITL", res.itl_ms), ("E2E", res.e2e_ms)):
        rows += [
            (f"Mean {name} (ms)", f"{st['mean']:.2f}"),
            (f"Median {name} (ms)", f"{st['median']:.2f}"),
            (f"P99 {name} (ms)", f"{st['p99']:.2f}"),
        ]
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 16)
    body = "\n".join(f"{k:<{width}}{v:>16}" for k, v in rows)
    return f"{line}\n{'Serving Benchmark Result':^{width + 16}}\n{line}\n{body}\n{line}"


def build_parser() -> argparse.ArgumentParser:
    """CLI flags (SGLang bench_serving names)."""
    p = argparse.ArgumentParser(prog="sglite bench serving", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="Server URL; default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=("sglite", "openai"), default="sglite",
                   help="sglite = native /generate (reports accept length); openai = /v1/completions")
    p.add_argument("--model", default=None, help="Model name for the OpenAI backend; default: first of /v1/models")
    p.add_argument("--dataset-name", choices=("random", "file"), default="random")
    p.add_argument("--dataset-path", default=None, help="JSONL with a 'prompt' field (dataset file)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--vocab-size", type=int, default=None, help="Token-id range for random prompts; default: the server's")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Requests/s (Poisson); inf = all at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--baseline-url", default=None,
                   help="A second server (e.g. the same model without speculation) run with the same workload; "
                        "prints sglite/baseline ratios")
    p.add_argument("--output-file", default=None, help="Write the result as JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark against a live server."""
    args = build_parser().parse_args(argv)
    base = args.base_url or f"http://{args.host}:{args.port}"
    info = httpx.get(f"{base}/get_model_info", timeout=30).json()
    model = args.model or httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    if args.dataset_name == "file":
        if not args.dataset_path:
            print("sglite bench serving: --dataset-name file needs --dataset-path", file=sys.stderr)
            return 2
        reqs = load_file_requests(args.dataset_path, args.num_prompts, args.random_output_len)
    else:
        vocab = args.vocab_size or int(info.get("vocab_size", 0))
        if vocab <= 8:
            print("sglite bench serving: cannot tell the vocabulary size; pass --vocab-size", file=sys.stderr)
            return 2
        reqs = make_random_requests(
            args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, vocab, args.seed
        )
    results = {}
    for label, url in (("sglite", base), ("baseline", args.baseline_url)):
        if url is None:
            continue
        name = model if url == base else (args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])
        results[label] = asyncio.run(
            run_benchmark(url, reqs, args.backend, name, args.max_concurrency, args.request_rate, args.seed,
                          show_progress=not args.disable_tqdm)
        )
        print(f"[{label}] {url}")
        print(format_result(results[label]))
    out: dict = {k: asdict(v) for k, v in results.items()}
    if "baseline" in results:
        out["ratios"] = compare_results(results["sglite"], results["baseline"])
        print("sglite / baseline: " + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratios"].items()))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if all(r.failed == 0 for r in results.values()) else 1


def compare_results(res: BenchResult, baseline: BenchResult) -> dict[str, float]:
    """Throughput ratios (> 1: sglite faster) and latency ratios (< 1: sglite faster)."""

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "output_throughput": ratio(res.output_throughput, baseline.output_throughput),
        "request_throughput": ratio(res.request_throughput, baseline.request_throughput),
        "mean_ttft": ratio(res.ttft_ms["mean"], baseline.ttft_ms["mean"]),
        "mean_tpot": ratio(res.tpot_ms["mean"], baseline.tpot_ms["mean"]),
        "mean_e2e": ratio(res.e2e_ms["mean"], baseline.e2e_ms["mean"]),
    }


if __name__ == "__main__":
    sys.exit(main())
