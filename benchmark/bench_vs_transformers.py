"""sglite against transformers `generate` on the same prompts, in one run: output tok/s and the ratio.

transformers runs static batches of `concurrency` prompts (its natural offline mode); sglite gets the
same prompts through `sglite.Engine` with at most `concurrency` requests in flight (continuous
batching). Greedy, fixed output length (EOS ignored on both sides), equal-length random prompts so
transformers needs no padding. The greedy outputs are compared too: they must match token for token
in fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import torch


def run_transformers(model_path: str, prompts: list[list[int]], output_len: int, concurrency: int, device: str) -> tuple[float, list[list[int]]]:
    """Static batches of `concurrency` prompts through `generate`; returns (wall seconds, outputs)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    # sglite's ignore_eos keeps EOS a valid token and just does not stop; min_new_tokens would instead
    # forbid EOS. Without an EOS id, generate runs exactly max_new_tokens with nothing suppressed.
    model.generation_config.eos_token_id = None
    outs: list[list[int]] = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), concurrency):
            ids = torch.tensor(prompts[i : i + concurrency], device=device)
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, do_sample=False, pad_token_id=0,
            )
            outs += gen[:, ids.shape[1]:].tolist()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outs


def main(argv: Optional[list[str]] = None) -> int:
    """Run both engines at each concurrency and print the throughput ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="Model dir; default: the embedded default model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="Write results as JSON here")
    args = p.parse_args(argv)
    import sglite
    from sglite.bench_offline import random_prompt_ids, resolve_model_dir, run_engine
    from sglite.srt.configs.model_config import ModelConfig

    model_path = resolve_model_dir(args.model_path, "bench_vs_transformers")
    vocab = ModelConfig.from_path(model_path).vocab_size
    prompts = random_prompt_ids(args.num_prompts, args.input_len, vocab, args.seed)
    sampling = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    engine = sglite.Engine(
        model_path=model_path, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
        disable_radix_cache=True,  # random prompts share nothing; keep the comparison about batching
        log_level="warning",
    )
    rows = []
    try:
        run_engine(engine, prompts[:1], sampling, 1)  # warm-up
        print(f"model {model_path}  device {args.device}  {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out")
        print(f"{'conc':>5} {'transformers tok/s':>19} {'sglite tok/s':>13} {'ratio':>7} {'same tokens':>12}")
        for c in args.concurrency:
            hf_wall, hf_out = run_transformers(model_path, prompts, args.output_len, c, args.device)
            res = run_engine(engine, prompts, sampling, c)
            hf_tok_s = args.num_prompts * args.output_len / hf_wall
            same = sum(a == b for a, b in zip(hf_out, res.output_ids))
            ratio = res.output_tok_s / hf_tok_s
            print(f"{c:>5} {hf_tok_s:>19.1f} {res.output_tok_s:>13.1f} {ratio:>6.2f}x {same:>6}/{len(prompts)}")
            rows.append({"concurrency": c, "transformers_tok_s": hf_tok_s, "sglite_tok_s": res.output_tok_s,
                         "ratio": ratio, "identical_outputs": same, "num_prompts": len(prompts)})
    finally:
        engine.shutdown()
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
