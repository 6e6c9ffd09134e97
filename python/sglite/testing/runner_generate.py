"""Greedy decoding straight on a ModelRunner (no scheduler): for tests and one-batch benchmarks."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sglite.srt.model_executor.forward_batch_info import ForwardMode


def greedy_generate(
    runner: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, shared_prefix_len: int = 0
) -> list[list[int]]:
    """Prefill every prompt, then decode ``max_new_tokens`` greedy tokens per request in one batch.

    With ``shared_prefix_len`` > 0 the first prompt is prefilled alone and the others reuse its first
    ``shared_prefix_len`` KV slots through req_to_token (their prefill is an EXTEND over that prefix),
    the way a prefix cache hit runs. The prefix must be page-aligned for page sizes > 1.
    """
    prompts = [list(p) for p in prompts]
    page = runner.token_to_kv_pool_allocator.page_size
    if shared_prefix_len:
        if shared_prefix_len % page != 0:
            raise ValueError(f"shared_prefix_len {shared_prefix_len} is not a multiple of page_size {page}")
        head = prompts[0][:shared_prefix_len]
        for i, p in enumerate(prompts):
            if p[:shared_prefix_len] != head or len(p) <= shared_prefix_len:
                raise ValueError(f"prompt {i} does not extend the shared prefix of length {shared_prefix_len}")
    rows = runner.req_to_token_pool.alloc(len(prompts))
    if rows is None:
        raise RuntimeError(f"no free req_to_token rows for {len(prompts)} requests")
    table = runner.req_to_token_pool.req_to_token
    if shared_prefix_len:
        first = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(rows[0], 0, prompts[0])]))
        for row in rows[1:]:
            table[row, :shared_prefix_len] = table[rows[0], :shared_prefix_len]
        rest = runner.forward(
            runner.build_forward_batch(
                ForwardMode.EXTEND,
                [(row, shared_prefix_len, p[shared_prefix_len:]) for row, p in zip(rows[1:], prompts[1:])],
            )
        ) if len(prompts) > 1 else None
        logits = first.next_token_logits
        if rest is not None:
            logits = torch.cat([logits, rest.next_token_logits], dim=0)
    else:
        out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)]))
        logits = out.next_token_logits
    next_ids = torch.argmax(logits, dim=-1).tolist()
    generated = [[t] for t in next_ids]
    seq_lens = [len(p) for p in prompts]
    for _ in range(max_new_tokens - 1):
        batch = runner.build_forward_batch(
            ForwardMode.DECODE, [(r, s, [g[-1]]) for r, s, g in zip(rows, seq_lens, generated)]
        )
        next_ids = torch.argmax(runner.forward(batch).next_token_logits, dim=-1).tolist()
        seq_lens = [s + 1 for s in seq_lens]
        for g, t in zip(generated, next_ids):
            g.append(t)
    return generated


def hf_greedy(hf_model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)`` continuations of each prompt, run one prompt at a time."""
    device = next(hf_model.parameters()).device
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=device)
        gen = hf_model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, len(p) :].tolist())
    return out


def scheduler_greedy_generate(scheduler: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (``ignore_eos``) of every prompt through an in-process Scheduler, in prompt order."""
    from sglite.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglite.srt.sampling.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add_request(
            TokenizedGenerateReqInput(rid=f"r{i}", input_text=None, input_ids=list(p), sampling_params=params)
        )
    ids: dict[str, list[int]] = {}
    for msg in scheduler.run_until_idle():
        for j, rid in enumerate(msg.rids):
            ids.setdefault(rid, []).extend(msg.output_ids[j])
    return [ids.get(f"r{i}", []) for i in range(len(prompts))]


@torch.no_grad()
def assert_decodes_like(runner: Any, hf_model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> None:
    """The runner's prefill logits equal transformers' within the fp32 tolerance its own float64 run calibrates,
    and its greedy continuations equal transformers', which must be non-degenerate and free of near-ties (exact
    token equality is CPU-independent only without them)."""
    from sglite.testing.fp32_reference import float64_copy, fp32_atol
    from sglite.testing.greedy_margin import assert_clear_greedy_margins

    rows = runner.req_to_token_pool.alloc(len(prompts))
    out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, list(p)) for r, p in zip(rows, prompts)]))
    runner.req_to_token_pool.free(rows)
    ref = torch.stack([hf_model(torch.tensor([list(p)])).logits[0, -1] for p in prompts])
    exact = torch.stack([float64_copy(hf_model)(torch.tensor([list(p)])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(out.next_token_logits, ref, atol=fp32_atol(ref, exact, floor=1e-4), rtol=0)
    expected = hf_greedy(hf_model, prompts, new_tokens)
    assert_clear_greedy_margins(hf_model, prompts, expected)
    assert all(len(set(e)) > 3 for e in expected), expected  # a degenerate model would say little
    assert greedy_generate(runner, prompts, new_tokens) == expected
