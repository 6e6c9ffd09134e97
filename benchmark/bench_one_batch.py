"""One static batch, no server: prefill latency and decode tok/s through sglite's ModelRunner and,
in the same run on the same weights and prompts, through transformers with its KV cache.

Like SGLang's bench_one_batch: the batch is prefilled once, then decoded step by step (greedy);
every step is timed. The ratio printed is sglite / transformers decode throughput (> 1: faster).
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
class OneBatchResult:
    """Timings of one engine on one batch shape."""

    engine: str
    batch_size: int
    input_len: int
    output_len: int
    prefill_latency_s: float
    prefill_tok_s: float
    median_decode_step_s: float
    decode_tok_s: float


def run_sglite(model_path: str, prompts: list[list[int]], output_len: int, device: str, backend: Optional[str]) -> OneBatchResult:
    """Prefill + decode through a ModelRunner (no scheduler)."""
    from sglite.srt.model_executor.forward_batch_info import ForwardMode
    from sglite.srt.model_executor.model_runner import ModelRunner
    from sglite.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=model_path, device=device, attention_backend=backend, dtype="float32" if device == "cpu" else "auto")
    sa.validate()
    runner = ModelRunner(sa)
    bs, n_in = len(prompts), len(prompts[0])
    rows = runner.req_to_token_pool.alloc(bs)
    if rows is None:
        raise RuntimeError(f"--batch-size {bs} exceeds the request table; lower it")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    # One untimed prefill of the same shape first (both engines), so the timed one is not a cold first call.
    warm = runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)])
    runner.forward(warm)
    runner.token_to_kv_pool_allocator.free(warm.out_cache_loc)
    sync()
    t0 = time.perf_counter()
    out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)]))
    next_ids = torch.argmax(out.next_token_logits, dim=-1).tolist()
    sync()
    prefill = time.perf_counter() - t0
    steps = []
    seq = n_in
    for _ in range(output_len - 1):
        t0 = time.perf_counter()
        batch = runner.build_forward_batch(ForwardMode.DECODE, [(r, seq, [t]) for r, t in zip(rows, next_ids)])
        next_ids = torch.argmax(runner.forward(batch).next_token_logits, dim=-1).tolist()
        sync()
        steps.append(time.perf_counter() - t0)
        seq += 1
    return _result("sglite", bs, n_in, output_len, prefill, steps)


def run_transformers(model_path: str, prompts: list[list[int]], output_len: int, device: str) -> OneBatchResult:
    """The same batch through transformers: one prefill forward, then one forward per token with its cache."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    bs, n_in = ids.shape

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        model(input_ids=ids, use_cache=True)  # the same untimed warm-up prefill as sglite's
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        prefill = time.perf_counter() - t0
        cache = out.past_key_values
        steps = []
        for _ in range(output_len - 1):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            steps.append(time.perf_counter() - t0)
    return _result("transformers", bs, n_in, output_len, prefill, steps)


def _median_run(runs: list[OneBatchResult]) -> OneBatchResult:
    """The run with the median decode throughput."""
    return sorted(runs, key=lambda r: r.decode_tok_s)[len(runs) // 2]


def _result(engine: str, bs: int, n_in: int, n_out: int, prefill: float, steps: list[float]) -> OneBatchResult:
    med = sorted(steps)[len(steps) // 2] if steps else 0.0
    return OneBatchResult(engine, bs, n_in, n_out, prefill, bs * n_in / prefill, med, bs / med if med else 0.0)


def main(argv: Optional[list[str]] = None) -> int:
    """Benchmark each batch size with both engines and print the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="Target model dir; default: the embedded default model")
    p.add_argument("--tiny-arch", default=None,
                   help="Instead of --model-path, a tiny random model of this family built with transformers' config "
                        "classes (sglite.testing.tiny_models: llama, qwen2, qwen3, qwen3_moe, deepseek_v3)")
    p.add_argument("--tiny-layers", type=int, default=4, help="Layers of the --tiny-arch model")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention-backend", default=None, help="sglite attention backend (default: per device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="Interleaved rounds per batch size (the engines' order alternates); medians are compared")
    p.add_argument("--result-file", default=None, help="Write results as JSON here")
    args = p.parse_args(argv)
    from sglite.bench_offline import random_prompt_ids, resolve_model_dir
    from sglite.srt.configs.model_config import ModelConfig

    if args.tiny_arch is not None:
        import tempfile

        from sglite.testing.tiny_models import build_tiny_model

        model_path = build_tiny_model(
            tempfile.mkdtemp(prefix=f"tiny-{args.tiny_arch}-"), args.tiny_arch, with_tokenizer=False,
            eos_token_id=None, num_hidden_layers=args.tiny_layers, max_position_embeddings=4096,
        )
    else:
        model_path = resolve_model_dir(args.model_path, "bench_one_batch")

    vocab = ModelConfig.from_path(model_path).vocab_size
    results = []
    print(f"model {model_path}  device {args.device}  input {args.input_len}  output {args.output_len}")
    print(f"{'bs':>4} {'engine':<13} {'prefill s':>10} {'prefill tok/s':>14} {'decode step ms':>15} {'decode tok/s':>13}")
    for bs in args.batch_size:
        prompts = random_prompt_ids(bs, args.input_len, vocab, args.seed)
        from sglite.srt.distributed.bootstrap import destroy_parallel_runtime

        rounds: dict[str, list[OneBatchResult]] = {"transformers": [], "sglite": []}
        for i in range(args.rounds):
            order = ("transformers", "sglite") if i % 2 == 0 else ("sglite", "transformers")
            for engine in order:
                if engine == "transformers":
                    rounds[engine].append(run_transformers(model_path, prompts, args.output_len, args.device))
                else:
                    rounds[engine].append(
                        run_sglite(model_path, prompts, args.output_len, args.device, args.attention_backend))
                    # The runner publishes the runtime context once per process: reset it for the next run.
                    destroy_parallel_runtime()
        pair = [_median_run(rounds["transformers"]), _median_run(rounds["sglite"])]
        for r in pair:
            print(f"{bs:>4} {r.engine:<13} {r.prefill_latency_s:>10.4f} {r.prefill_tok_s:>14.1f} "
                  f"{1000 * r.median_decode_step_s:>15.2f} {r.decode_tok_s:>13.1f}")
        ratio = pair[1].decode_tok_s / pair[0].decode_tok_s
        print(f"{bs:>4} ratio sglite/transformers decode tok/s = {ratio:.2f}x, prefill = "
              f"{pair[0].prefill_latency_s / pair[1].prefill_latency_s:.2f}x")
        results += [asdict(r) | {"ratio_decode": ratio} for r in pair]
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
