#!/usr/bin/env python3
"""Acceptance of the default pair (SmolLM2-135M-Instruct GGUF + its DFLASH draft) on held-out chat prompts.

Prompts are the held-out split of ``scripts/default_draft_prompts.py`` (subjects no training prompt
has), rendered with the model's chat template. One sglite Engine with DFLASH decodes them all
greedily and at temperature 0.7; a plain Engine (no draft) decodes them greedily as the lossless
reference. Reported per mode: SGLang's accept length (``completion_tokens / spec_verify_ct``, the
bonus token included) and the same without the prefill's first token (``(completion - 1) / verify``).

    .venv/bin/python benchmark/bench_default_draft.py --num-prompts 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))


def heldout_chat_ids(tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat-template token ids of the first ``num_prompts`` held-out prompts."""
    from default_draft_prompts import build_prompts

    _, heldout = build_prompts()
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for p in heldout[:num_prompts]
    ]


def accept_lengths(outs: list[dict]) -> dict:
    """SGLang's accept length and the one without the prefill token, over a batch of outputs."""
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    return {
        "accept_length": round(completion / verify, 4),
        "accept_length_without_prefill_token": round((completion - len(outs)) / verify, 4),
        "completion_tokens": completion,
        "verify_steps": verify,
    }


def transformers_check(model_path: str, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens: int, eos: int) -> dict:
    """transformers' greedy replies on the same GGUF vs ``outputs``: equal count, and near-ties (margin < 2e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglite.testing.greedy_margin import MIN_GREEDY_MARGIN, greedy_margins

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    ).eval()
    equal, near_ties, mismatched = 0, 0, []
    for i, (ids, out) in enumerate(zip(prompts, outputs)):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
        ref = gen[0, len(ids):].tolist()
        out = [t for t in out][: len(out) - (len(out) > 0 and out[-1] == eos)]  # compare without the eos
        ref = ref[: len(ref) - (len(ref) > 0 and ref[-1] == eos)]
        margin = float(greedy_margins(model, ids, ref).min())
        near_ties += margin < MIN_GREEDY_MARGIN
        if ref == list(out):
            equal += 1
        else:
            mismatched.append({"prompt": i, "min_margin": margin})
    return {"prompts": len(prompts), "equal": equal, "near_tie_prompts": near_ties, "mismatched": mismatched}


def main(argv: Optional[list[str]] = None) -> None:
    """Decode the held-out prompts with and without the draft; print a JSON summary."""
    from sglite.srt.default_model import DEFAULT_DRAFT_DIR, default_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="default: the default model's GGUF")
    parser.add_argument("--draft-path", default=DEFAULT_DRAFT_DIR)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--block-size", type=int, default=None, help="default: the draft's")
    parser.add_argument("--speculative-token-map", default=None,
                        help="draft only these token ids (a .pt file; default: the full vocabulary)")
    parser.add_argument("--skip-plain", action="store_true", help="skip the lossless check against a plain engine")
    parser.add_argument("--transformers-prompts", type=int, default=0,
                        help="also compare the first N greedy outputs with transformers on the same GGUF")
    args = parser.parse_args(argv)
    for key, value in {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    import sglite

    model_path = args.model_path or default_model_path()
    result: dict = {"model_path": model_path, "draft_path": args.draft_path, "max_new_tokens": args.max_new_tokens,
                    "speculative_token_map": args.speculative_token_map}
    engine = sglite.Engine(
        model_path=model_path,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=args.draft_path,
        speculative_num_draft_tokens=args.block_size,
        speculative_token_map=args.speculative_token_map,
        device="cpu",
        log_level="warning",
    )
    try:
        prompts = heldout_chat_ids(engine.tokenizer, args.num_prompts)
        eos = engine.tokenizer.eos_token_id
        result["num_prompts"] = len(prompts)
        t0 = time.perf_counter()
        greedy = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0})
        result["greedy"] = {**accept_lengths(greedy), "wall_seconds": round(time.perf_counter() - t0, 1)}
        t0 = time.perf_counter()
        sampled = engine.generate(
            input_ids=prompts,
            sampling_params=[
                {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": i}
                for i in range(len(prompts))
            ],
        )
        result[f"temperature_{args.temperature}"] = {**accept_lengths(sampled), "wall_seconds": round(time.perf_counter() - t0, 1)}
    finally:
        engine.shutdown()
    if not args.skip_plain:
        plain = sglite.Engine(model_path=model_path, device="cpu", log_level="warning")
        try:
            ref = plain.generate(input_ids=prompts, sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0})
        finally:
            plain.shutdown()
        result["greedy"]["equal_to_plain_greedy"] = sum(a["output_ids"] == b["output_ids"] for a, b in zip(greedy, ref))
    if args.transformers_prompts:
        n = args.transformers_prompts
        result["greedy_vs_transformers"] = transformers_check(
            model_path, prompts[:n], [o["output_ids"] for o in greedy[:n]], args.max_new_tokens, eos
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
