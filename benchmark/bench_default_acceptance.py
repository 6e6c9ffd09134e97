#!/usr/bin/env python3
"""Mean acceptance length of the embedded default DFLASH pair on held-out prompts (greedy).

Prompts come from the held-out stdlib files of scripts/train_default_pair.py (same split rule):
half raw-code prefixes, half chat requests ("Write a Python function `f`: <docstring summary>").
Decoding uses the reference loop `dflash.model.dflash_generate` (z-lab dflash 0.1.0) at
temperature 0 with block size B (default: the draft's, 8). Acceptance length per verify step
= tokens committed by that step including the bonus token (1 <= tau <= B), SGLang's
"accept length"; the mean is total committed tokens / verify steps. Each output is also checked
token-for-token against plain greedy decoding of the target (`generate(do_sample=False)`).

With ``--engine sglite`` the same prompts go through ``sglite.Engine`` (DFLASH on, CPU, one batch);
acceptance per request = its ``completion_tokens / spec_verify_ct`` (SGLang's definition, which counts
the prefill's first token too) and, comparable with the reference loop, ``(completion_tokens - 1) /
spec_verify_ct``; outputs are checked against target greedy as well.

    .venv/bin/python benchmark/bench_default_acceptance.py                  # shipped pair, 32 prompts
    .venv/bin/python benchmark/bench_default_acceptance.py --engine sglite  # through sglite's DFLASH worker
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS = REPO_ROOT / "python" / "sglite" / "assets"


def load_training_module():
    """The training script as a module: the held-out split and prompt builders live there."""
    path = REPO_ROOT / "scripts" / "train_default_pair.py"
    spec = importlib.util.spec_from_file_location("train_default_pair", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_default_pair"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Prompt:
    """One benchmark prompt."""

    kind: str  # "code" or "chat"
    input_ids: list[int]


@dataclass
class PromptResult:
    """Per-prompt outcome of one speculative greedy decode."""

    kind: str
    prompt_tokens: int
    output_tokens: int
    acceptance_lengths: list[int]
    matches_greedy: bool


@dataclass
class BenchResult:
    """Aggregate numbers printed as JSON."""

    engine: str
    model_path: str
    draft_path: str
    block_size: int
    num_prompts: int
    max_new_tokens: int
    mean_acceptance_length: float
    mean_acceptance_length_by_kind: dict[str, float]
    acceptance_length_histogram: dict[int, int]
    verify_steps: int
    output_tokens: int
    greedy_exact_matches: int
    wall_seconds: float
    per_prompt: list[PromptResult] = field(default_factory=list)


def heldout_prompts(train_mod, tokenizer, num_prompts: int, seed: int, min_len: int, max_len: int) -> list[Prompt]:
    """Half code prefixes, half chat requests, all from held-out files (never seen in training)."""
    corpus = train_mod.load_corpus(train_mod.PairConfig.heldout_percent)
    texts = [t for _, t in corpus.heldout]
    pairs = [p for t in texts for p in train_mod.chat_examples(t)]
    stream = train_mod.encode_stream(tokenizer, texts)
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for i in range(num_prompts):
        if i % 2 == 0:
            length = rng.randint(min_len, max_len)
            start = rng.randrange(0, stream.numel() - length)
            prompts.append(Prompt("code", stream[start : start + length].tolist()))
        else:
            user, _ = pairs[rng.randrange(len(pairs))]
            text = train_mod.render_chat(tokenizer, user, None)
            prompts.append(Prompt("chat", tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def run_dflash(draft, target, prompt: Prompt, max_new_tokens: int, block_size: int, eos_id: int) -> PromptResult:
    """One greedy speculative decode with the reference loop, checked against target greedy."""
    import dflash.model as dm

    ids = torch.tensor([prompt.input_ids])
    stats = dm.dflash_generate(
        draft, target, ids, max_new_tokens=max_new_tokens, stop_token_ids=[eos_id],
        temperature=0.0, block_size=block_size, return_stats=True,
    )
    spec_out = stats.output_ids[0, ids.shape[1] :].tolist()
    ref_out = reference_greedy(target, prompt, max_new_tokens, eos_id)
    return PromptResult(
        kind=prompt.kind,
        prompt_tokens=ids.shape[1],
        output_tokens=len(spec_out),
        acceptance_lengths=[int(a) for a in stats.acceptance_lengths],
        matches_greedy=spec_out == ref_out,
    )


def reference_greedy(target, prompt: Prompt, max_new_tokens: int, eos_id: int) -> list[int]:
    """Plain greedy decode of the target, up to and including the first eos."""
    with torch.inference_mode():
        ids = torch.tensor([prompt.input_ids])
        out = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=eos_id)
    gen = out[0, ids.shape[1] :].tolist()
    return gen[: gen.index(eos_id) + 1] if eos_id in gen else gen


def run_sglite(args, target, prompts: list[Prompt], block_size: int, eos_id: int) -> dict:
    """All prompts in one batch through sglite.Engine with DFLASH; per-request acceptance from meta_info."""
    import sglite

    for key, value in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    refs = [reference_greedy(target, p, args.max_new_tokens, eos_id) for p in tqdm(prompts, desc="reference greedy")]
    engine = sglite.Engine(
        model_path=args.model_path,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=args.draft_path,
        speculative_num_draft_tokens=block_size,
        device="cpu",
    )
    try:
        t0 = time.perf_counter()
        outs = engine.generate(
            input_ids=[p.input_ids for p in prompts],
            sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0},
        )
        wall = time.perf_counter() - t0
        server_avg = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    finally:
        engine.shutdown()
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    by_kind = {}
    for kind in sorted({p.kind for p in prompts}):
        sel = [o for o, p in zip(outs, prompts) if p.kind == kind]
        by_kind[kind] = round(
            sum(o["meta_info"]["completion_tokens"] - 1 for o in sel) / sum(o["meta_info"]["spec_verify_ct"] for o in sel), 4
        )
    return {
        "engine": "sglite",
        "model_path": args.model_path,
        "draft_path": args.draft_path,
        "block_size": block_size,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "mean_acceptance_length": round((completion - len(outs)) / verify, 4),
        "mean_acceptance_length_by_kind": by_kind,
        "sglang_accept_length": round(completion / verify, 4),
        "server_avg_spec_accept_length": server_avg,
        "verify_steps": verify,
        "output_tokens": completion,
        "greedy_exact_matches": sum(o["output_ids"] == r for o, r in zip(outs, refs)),
        "wall_seconds": round(wall, 1),
    }


def main(argv: Optional[list[str]] = None) -> None:
    """Load the pair, decode every prompt, print the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=str(ASSETS / "default_model"))
    parser.add_argument("--draft-path", default=str(ASSETS / "default_draft"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None, help="default: the draft's dflash_config.block_size")
    parser.add_argument("--prompt-min-tokens", type=int, default=32)
    parser.add_argument("--prompt-max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--per-prompt", action="store_true", help="include per-prompt results in the JSON")
    parser.add_argument("--engine", choices=["dflash", "sglite"], default="dflash",
                        help="dflash: the z-lab reference loop (batch 1); sglite: sglite.Engine with DFLASH")
    args = parser.parse_args(argv)

    import dflash.model as dm
    from dflash.model import DFlashDraftModel
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    # dflash_generate(return_stats=True) times with torch.cuda.synchronize; on CPU use a plain clock.
    dm._cuda_time = time.perf_counter
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    target = Qwen3ForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(args.draft_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    block_size = args.block_size or draft.block_size

    train_mod = load_training_module()
    prompts = heldout_prompts(train_mod, tokenizer, args.num_prompts, args.seed, args.prompt_min_tokens, args.prompt_max_tokens)
    if args.engine == "sglite":
        print(json.dumps(run_sglite(args, target, prompts, block_size, tokenizer.eos_token_id), indent=2))
        return
    t0 = time.perf_counter()
    results = [
        run_dflash(draft, target, p, args.max_new_tokens, block_size, tokenizer.eos_token_id)
        for p in tqdm(prompts, desc="prompts")
    ]
    wall = time.perf_counter() - t0

    def mean_tau(rs: list[PromptResult]) -> float:
        steps = sum(len(r.acceptance_lengths) for r in rs)
        return sum(sum(r.acceptance_lengths) for r in rs) / max(1, steps)

    hist = Counter(a for r in results for a in r.acceptance_lengths)
    summary = BenchResult(
        engine="dflash",
        model_path=args.model_path,
        draft_path=args.draft_path,
        block_size=block_size,
        num_prompts=len(prompts),
        max_new_tokens=args.max_new_tokens,
        mean_acceptance_length=round(mean_tau(results), 4),
        mean_acceptance_length_by_kind={
            k: round(mean_tau([r for r in results if r.kind == k]), 4) for k in sorted({r.kind for r in results})
        },
        acceptance_length_histogram={t: hist.get(t, 0) for t in range(1, block_size + 1)},
        verify_steps=sum(len(r.acceptance_lengths) for r in results),
        output_tokens=sum(r.output_tokens for r in results),
        greedy_exact_matches=sum(r.matches_greedy for r in results),
        wall_seconds=round(wall, 1),
        per_prompt=results if args.per_prompt else [],
    )
    out = asdict(summary)
    if not args.per_prompt:
        out.pop("per_prompt")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
