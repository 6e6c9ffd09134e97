"""Serving-stall regression benchmark: ITL p99 against p50 of a sglite server, over back-to-back runs.

Starts ``sglite serve`` (plain, the embedded default model unless --model-path), runs the load generator
(``sglite.bench_serving``: 16 random prompts, 64 in / 32 out, all at once, as the stall report did)
``--runs`` times, and prints per run the output tok/s, ITL p50 / p99 and p99/p50. Exit status 1 when any
run's p99/p50 exceeds ``--max-ratio`` (3 by default; meaningful on a quiet box). ``--server-env`` adds
environment to the server, e.g. ``OMP_WAIT_POLICY=ACTIVE`` with ``--cpu-threads 2`` reproduces the stalls
that managers/cpu_threads.py removes.

    python benchmark/bench_itl_stalls.py --runs 3
    python benchmark/bench_itl_stalls.py --server-args "--cpu-threads 2" --server-env OMP_WAIT_POLICY=ACTIVE
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    """Run the server and the load generator; print the ITL tail per run; non-zero exit on a stall."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the embedded default model, without its draft")
    p.add_argument("--server-args", default="", help="extra `sglite serve` flags, e.g. '--cpu-threads 2'")
    p.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server's environment")
    p.add_argument("--port", type=int, default=31960)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-ratio", type=float, default=3.0, help="fail when ITL p99 / p50 exceeds this")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once); a finite rate lands prefills between decode steps",
    )
    args = p.parse_args(argv)

    import httpx

    from sglite.bench_offline import resolve_model_dir
    from sglite.bench_serving import make_random_requests, run_benchmark

    model = resolve_model_dir(args.model_path, "bench_itl_stalls")
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.server_env)
    cmd = [sys.executable, "-m", "sglite.launch_server", "--model-path", model, "--port", str(args.port),
           "--log-level", "warning", *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    worst = 0.0
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        vocab = httpx.get(f"{url}/get_model_info", timeout=5).json().get("vocab_size")
        print(
            f"server: {' '.join(cmd[3:])}  env: {args.server_env or '-'}  request rate: {args.request_rate}/s  "
            f"load avg {os.getloadavg()[0]:.2f}"
        )
        warm = make_random_requests(2, args.input_len, args.output_len, 1.0, vocab or 4096, seed=99)
        asyncio.run(run_benchmark(url, warm, "sglite", "default", None, float("inf"), 99, False))  # first-use costs
        print(f"{'run':>3} {'out tok/s':>10} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'p99/p50':>8}")
        for run in range(args.runs):
            reqs = make_random_requests(args.num_prompts, args.input_len, args.output_len, 1.0, vocab or 4096, seed=run)
            res = asyncio.run(run_benchmark(url, reqs, "sglite", "default", None, args.request_rate, run, False))
            p50, p99 = res.itl_ms["median"], res.itl_ms["p99"]
            ratio = p99 / p50 if p50 else float("inf")
            worst = max(worst, ratio)
            print(f"{run:>3} {res.output_throughput:>10.1f} {p50:>11.1f} {p99:>11.1f} {ratio:>8.2f}", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    verdict = "ok" if worst <= args.max_ratio else "STALLS"
    print(f"worst ITL p99/p50 = {worst:.2f} (goal <= {args.max_ratio}): {verdict}; load avg {os.getloadavg()[0]:.2f}")
    return 0 if worst <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
