"""Decode tok/s through ModelRunner with CUDA graphs against the same runner config with --disable-cuda-graph.

One static batch per batch size: prefill once, then greedy decode steps, each timed with a device
sync; the median step gives tok/s. Both runs use the same weights, prompts and attention backend
(Triton), so the ratio is what graph replay saves in launch overhead. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch


@dataclass
class GraphDecodeResult:
    """Decode speed of one batch size with and without CUDA graphs."""

    batch_size: int
    input_len: int
    decode_steps: int
    eager_step_ms: float
    graph_step_ms: float
    eager_tok_s: float
    graph_tok_s: float
    speedup: float
    same_tokens: bool  # greedy tokens identical with and without graphs


def _decode(model_path: str, prompts: list[list[int]], steps: int, graphs: bool, max_bs: int) -> tuple[list[float], list[list[int]]]:
    """Per-step seconds and greedy tokens of one runner (graphs on or off)."""
    from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
    from sglite.srt.model_executor.forward_batch_info import ForwardMode
    from sglite.srt.model_executor.model_runner import ModelRunner
    from sglite.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_path, device="cuda", attention_backend="triton", disable_cuda_graph=not graphs,
        cuda_graph_max_bs=max_bs, max_running_requests=max(max_bs, len(prompts)), max_total_tokens=65536,
    ).validate()
    try:
        runner = ModelRunner(args)
        if graphs and not runner.cuda_graph_runners:
            raise RuntimeError("the runner captured no CUDA graphs (see the log line 'CUDA graphs off: ...')")
        rows = runner.req_to_token_pool.alloc(len(prompts))
        out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)]))
        tokens = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
        seq = len(prompts[0])
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fb = runner.build_forward_batch(ForwardMode.DECODE, [(r, seq, [t[-1]]) for r, t in zip(rows, tokens)])
            nxt = runner.forward(fb).next_token_logits.argmax(-1).tolist()  # the host read syncs
            times.append(time.perf_counter() - t0)
            for t, n in zip(tokens, nxt):
                t.append(n)
            seq += 1
        return times, tokens
    finally:
        destroy_parallel_runtime()


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv: Optional[list[str]] = None) -> int:
    """Run each batch size with and without graphs and print the decode speed-up."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="Model dir; default: the embedded default model")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="Write results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda_graph: needs a CUDA device (CUDA graphs are CUDA-only)", file=sys.stderr)
        return 2
    from sglite.bench_offline import random_prompt_ids, resolve_model_dir
    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.runtime_context import ParallelState, scoped

    model_path = resolve_model_dir(args.model_path, "bench_cuda_graph")
    vocab = ModelConfig.from_path(model_path).vocab_size
    max_bs = max(args.batch_size)
    print(f"model {model_path}  input {args.input_len}  decode steps {args.decode_steps}")
    print(f"{'bs':>4} {'eager ms':>9} {'graph ms':>9} {'eager tok/s':>12} {'graph tok/s':>12} {'speed-up':>9}")
    results = []
    for bs in args.batch_size:
        prompts = random_prompt_ids(bs, args.input_len, vocab, args.seed)
        runs = {}
        for graphs in (False, True):
            with scoped(parallel=ParallelState(tp_size=1)):
                runs[graphs] = _decode(model_path, prompts, args.decode_steps, graphs, max_bs)
        eager, graph = _median(runs[False][0]), _median(runs[True][0])
        r = GraphDecodeResult(
            batch_size=bs, input_len=args.input_len, decode_steps=args.decode_steps,
            eager_step_ms=1000 * eager, graph_step_ms=1000 * graph, eager_tok_s=bs / eager, graph_tok_s=bs / graph,
            speedup=eager / graph, same_tokens=runs[False][1] == runs[True][1],
        )
        results.append(r)
        print(f"{bs:>4} {r.eager_step_ms:>9.2f} {r.graph_step_ms:>9.2f} {r.eager_tok_s:>12.1f} {r.graph_tok_s:>12.1f} "
              f"{r.speedup:>8.2f}x{'' if r.same_tokens else '  (greedy tokens differ!)'}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0 if all(r.same_tokens for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
