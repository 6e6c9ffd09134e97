"""DFLASH speed-up on the embedded default pair: sglite with and without the draft, in one run.

Held-out prompts (the training script's held-out files, via bench_default_acceptance), greedy,
fixed max_new_tokens. For each concurrency it prints output tok/s without and with DFLASH, the
speed-up, the accept length (completion tokens / verify steps, SGLang's definition) and whether the
speculative outputs equal the plain ones token for token (greedy speculation is lossless).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _heldout_prompts(model_path: str, num_prompts: int, seed: int) -> list[list[int]]:
    """The same held-out prompts bench_default_acceptance measures acceptance on."""
    spec = importlib.util.spec_from_file_location("bench_default_acceptance", os.path.join(HERE, "bench_default_acceptance.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_default_acceptance"] = mod  # its dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = mod.heldout_prompts(mod.load_training_module(), tokenizer, num_prompts, seed, 16, 48)
    return [p.input_ids for p in prompts]


def main(argv: Optional[list[str]] = None) -> int:
    """Run plain and DFLASH engines on the same prompts and print the speed-up per concurrency."""
    from sglite.launch_server import DEFAULT_DRAFT_DIR, DEFAULT_MODEL_DIR

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL_DIR)
    p.add_argument("--draft-model-path", default=DEFAULT_DRAFT_DIR)
    p.add_argument("--speculative-algorithm", default="DFLASH", choices=("DFLASH", "DSPARK"))
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="B; default: the checkpoint's")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="Write results as JSON here")
    args = p.parse_args(argv)
    for path in (args.model_path, args.draft_model_path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            print(f"bench_spec: no model at {path}; pass --model-path / --draft-model-path", file=sys.stderr)
            return 2

    import sglite
    from sglite.bench_offline import run_engine

    prompts = _heldout_prompts(args.model_path, args.num_prompts, args.seed)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    common = dict(model_path=args.model_path, device=args.device, attention_backend=args.attention_backend,
                  disable_radix_cache=True, log_level="warning")
    results: dict[str, dict[int, object]] = {}
    for name, extra in (
        ("plain", {}),
        ("spec", {"speculative_algorithm": args.speculative_algorithm,
                  "speculative_draft_model_path": args.draft_model_path,
                  "speculative_num_draft_tokens": args.speculative_num_draft_tokens}),
    ):
        engine = sglite.Engine(**common, **extra)
        try:
            run_engine(engine, prompts[:1], sampling, 1)  # warm-up
            results[name] = {c: run_engine(engine, prompts, sampling, c) for c in args.concurrency}
        finally:
            engine.shutdown()

    print(f"{args.speculative_algorithm} on {args.model_path} + {args.draft_model_path}; device {args.device}; "
          f"{len(prompts)} held-out prompts, greedy, max_new_tokens {args.max_new_tokens}")
    print(f"{'conc':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9} {'accept len':>11} {'identical':>10}")
    rows = []
    for c in args.concurrency:
        base, spec = results["plain"][c], results["spec"][c]
        same = sum(a == b for a, b in zip(base.output_ids, spec.output_ids))
        speedup = spec.output_tok_s / base.output_tok_s
        print(f"{c:>5} {base.output_tok_s:>12.1f} {spec.output_tok_s:>11.1f} {speedup:>8.2f}x "
              f"{spec.accept_length or 0:>11.2f} {same:>5}/{len(prompts)}")
        rows.append({"concurrency": c, "plain_tok_s": base.output_tok_s, "spec_tok_s": spec.output_tok_s,
                     "speedup": speedup, "accept_length": spec.accept_length, "identical_outputs": same,
                     "num_prompts": len(prompts)})
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
