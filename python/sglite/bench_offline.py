"""Offline throughput through `sglite.Engine` with a bounded number of requests in flight.

Shared by the benchmarks that compare sglite with a baseline in one run (bench_vs_transformers,
bench_spec): the Engine's continuous batching sees at most ``max_concurrency`` requests at a time.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from sglite.srt.managers.io_struct import GenerateReqInput


def resolve_model_dir(model_path: Optional[str], prog: str) -> str:
    """The model to benchmark (default: the default model's GGUF); exit 2 naming the flag if absent."""
    from sglite.srt.default_model import default_model_path
    from sglite.srt.configs.gguf import find_gguf_file
    from sglite.srt.server_args import ServerArgsError

    try:
        path = model_path or default_model_path()
    except ServerArgsError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not (os.path.isfile(os.path.join(path, "config.json")) or find_gguf_file(path)):
        print(f"{prog}: no model at {path}; pass --model-path", file=sys.stderr)
        raise SystemExit(2)
    return path


def random_prompt_ids(num_prompts: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Equal-length random prompts; ids below 8 are skipped (small vocabularies keep special tokens there)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab_size, (num_prompts, length), generator=g).tolist()


@dataclass
class OfflineResult:
    """Outputs and throughput of one offline run."""

    output_ids: list[list[int]]
    wall_s: float
    output_tokens: int
    verify_steps: int
    meta_infos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def accept_length(self) -> Optional[float]:
        """Completion tokens per verify step (speculative runs), as SGLang reports it."""
        return self.output_tokens / self.verify_steps if self.verify_steps else None


def run_engine(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    sampling_params: dict[str, Any],
    max_concurrency: int,
) -> OfflineResult:
    """Generate every prompt (token ids) with at most ``max_concurrency`` requests in flight."""
    sem = asyncio.Semaphore(max_concurrency)
    results: list[Optional[dict[str, Any]]] = [None] * len(prompts)

    async def one(i: int, ids: Sequence[int]) -> None:
        async with sem:
            obj = GenerateReqInput(input_ids=list(ids), sampling_params=dict(sampling_params))
            final = None
            async for out in engine.tokenizer_manager.generate_request(obj):
                final = out
            results[i] = final

    async def run_all() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - start

    wall = engine._run(run_all())
    outs = [r for r in results if r is not None]
    if len(outs) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(outs)} requests returned nothing")
    metas = [o["meta_info"] for o in outs]
    for m in metas:
        reason = m.get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise RuntimeError(f"a benchmark request was aborted: {reason.get('message')}")
    return OfflineResult(
        output_ids=[list(o["output_ids"]) for o in outs],
        wall_s=wall,
        output_tokens=sum(int(m["completion_tokens"]) for m in metas),
        verify_steps=sum(int(m.get("spec_verify_ct") or 0) for m in metas),
        meta_infos=metas,
    )
