"""DFLASH speed-up on the default pair (SmolLM2-135M-Instruct GGUF + its draft): sglite with and without the draft.

Held-out prompts, greedy, fixed max_new_tokens: ``--prompt-set chat`` (default) takes the held-out chat
prompts of ``scripts/default_draft_prompts.py`` through the model's chat template (via
bench_default_draft); ``--prompt-set toy`` the toy pair's held-out code/chat prompts (via
bench_default_acceptance), for ``--model-path python/sglite/assets/default_model``. For each concurrency it prints output tok/s without and with DFLASH, the
speed-up, the accept length (completion tokens / verify steps, SGLang's definition) and whether the
speculative outputs equal the plain ones token for token (greedy speculation is lossless).

``--dspark-cap-thresholds T ...`` measures DSPARK's cap-accept verify mode instead: the default
DFLASH draft becomes a DSPARK draft (zeroed Markov head, DFlash slot convention, so its drafts are
the DFLASH drafts) whose confidence head is fitted here by logistic regression on acceptance
outcomes of other held-out prompts; then static and cap-accept (one run per threshold) are compared
on target tokens verified per step, accept length and tok/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("plain", "spec", "adaptive", "draft-off")


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def _heldout_prompts(model_path: str, prompt_set: str, num_prompts: int, seed: int) -> list[list[int]]:
    """The held-out prompts the acceptance benchmarks measure on (bench_default_draft / bench_default_acceptance)."""
    from sglite.srt.managers.detokenizer_manager import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if prompt_set == "chat":
        return _load_bench("bench_default_draft").heldout_chat_ids(tokenizer, num_prompts)
    mod = _load_bench("bench_default_acceptance")
    prompts = mod.heldout_prompts(mod.load_training_module(), tokenizer, num_prompts, seed, 16, 48)
    return [p.input_ids for p in prompts]


def main(argv: Optional[list[str]] = None) -> int:
    """Run plain and DFLASH engines on the same prompts and print the speed-up per concurrency."""
    from sglite.bench_offline import resolve_model_dir
    from sglite.srt.default_model import DEFAULT_DRAFT_DIR, DEFAULT_DRAFT_TOKEN_MAP_FILE

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the default model's GGUF")
    p.add_argument("--draft-model-path", default=DEFAULT_DRAFT_DIR)
    p.add_argument("--speculative-token-map", default=None,
                   help="hot token ids of the draft head (.pt); default: the draft folder's token_map.pt if it has "
                        "one (as sglite serve does for the bundled draft); 'none': the full head")
    p.add_argument("--speculative-draft-model-quantization", default=None, choices=("q8_0", "none"),
                   help="the draft's weights; default: what `sglite serve` does (q8_0 for the bundled draft on CPU)")
    p.add_argument("--prompt-set", default="chat", choices=("chat", "toy"))
    p.add_argument("--speculative-algorithm", default="DFLASH", choices=("DFLASH", "DSPARK"))
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="B; default: what `sglite serve` uses with the bundled draft (3 on CPU), else the checkpoint's")
    p.add_argument("--variants", nargs="+", default=["plain", "spec"], choices=VARIANTS,
                   help="plain: no draft; spec: the draft on every step; adaptive: --speculative-adaptive "
                        "(draft only while it pays, the default server's setting); draft-off: the draft loaded but never "
                        "run (--speculative-disable-by-batch-size 1: what keeping its context K/V costs); the first is "
                        "the baseline")
    p.add_argument("--rounds", type=int, default=2, help="Interleaved rounds (the order flips every round); medians")
    p.add_argument("--engines-alive-together", action="store_true",
                   help="start every variant's engine once and alternate the runs between them (one idle engine's "
                        "scheduler sleeps); default: a fresh engine per variant and round. Together, a round is a "
                        "run per concurrency seconds apart, so the box's drift over minutes (+-10%% here) and the "
                        "start-up order cancel out of the ratios")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="Every variant with --enable-torch-compile (CPU: decode and, with a draft, verify compiled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning",
                   help="the engines' log level; info shows --speculative-adaptive's per-bucket choices and timings")
    p.add_argument("--result-file", default=None, help="Write results as JSON here")
    p.add_argument("--dspark-cap-thresholds", type=float, nargs="+", default=None,
                   help="Measure DSPARK cap-accept at these thresholds (see the module docstring)")
    args = p.parse_args(argv)
    args.model_path = resolve_model_dir(args.model_path, "bench_spec")
    if not os.path.isfile(os.path.join(args.draft_model_path, "config.json")):
        print(f"bench_spec: no draft at {args.draft_model_path}; pass --draft-model-path", file=sys.stderr)
        return 2
    if args.dspark_cap_thresholds:
        return bench_dspark_cap(args)

    import sglite
    from sglite.bench_offline import run_engine
    from sglite.srt.default_model import DEFAULT_DRAFT_DIR, default_draft_num_draft_tokens

    prompts = _heldout_prompts(args.model_path, args.prompt_set, args.num_prompts, args.seed)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    common = dict(model_path=args.model_path, device=args.device, attention_backend=args.attention_backend,
                  disable_radix_cache=True, log_level=args.log_level, enable_torch_compile=args.enable_torch_compile)
    token_map = args.speculative_token_map
    if token_map is None:
        shipped = os.path.join(args.draft_model_path, DEFAULT_DRAFT_TOKEN_MAP_FILE)
        token_map = shipped if os.path.isfile(shipped) else None
    elif token_map == "none":
        token_map = None
    num_draft_tokens = args.speculative_num_draft_tokens
    if num_draft_tokens is None and os.path.realpath(args.draft_model_path) == os.path.realpath(DEFAULT_DRAFT_DIR):
        # What `sglite serve` verifies with the bundled draft on this device (3 on CPU), not the checkpoint's 5.
        num_draft_tokens = default_draft_num_draft_tokens(args.speculative_algorithm, args.device)
    spec_args = {"speculative_algorithm": args.speculative_algorithm,
                 "speculative_draft_model_path": args.draft_model_path,
                 "speculative_num_draft_tokens": num_draft_tokens,
                 "speculative_token_map": token_map,
                 "speculative_draft_model_quantization": args.speculative_draft_model_quantization}
    extras = {"plain": {}, "spec": {**spec_args, "speculative_adaptive": False},
              "adaptive": {**spec_args, "speculative_adaptive": True},
              "draft-off": {**spec_args, "speculative_adaptive": False, "speculative_disable_by_batch_size": 1}}
    runs: dict[str, dict[int, list]] = {v: {c: [] for c in args.concurrency} for v in args.variants}

    def start(name: str):
        engine = sglite.Engine(**common, **extras[name])
        try:
            run_engine(engine, prompts[:1], sampling, 1)  # warm-up
        except BaseException:
            engine.shutdown()
            raise
        return engine

    if args.engines_alive_together:
        engines = {}
        try:
            for name in args.variants:
                engines[name] = start(name)
            for r in range(args.rounds):
                for c in args.concurrency:
                    for name in args.variants if r % 2 == 0 else args.variants[::-1]:
                        runs[name][c].append(run_engine(engines[name], prompts, sampling, c))
        finally:
            for engine in engines.values():
                engine.shutdown()
    else:
        for r in range(args.rounds):
            for name in args.variants if r % 2 == 0 else args.variants[::-1]:
                engine = start(name)
                try:
                    for c in args.concurrency:
                        runs[name][c].append(run_engine(engine, prompts, sampling, c))
                finally:
                    engine.shutdown()

    base_name = args.variants[0]
    print(f"{args.speculative_algorithm} on {args.model_path} + {args.draft_model_path}; token map {token_map}; device {args.device}"
          f"{' (--enable-torch-compile)' if args.enable_torch_compile else ''}; "
          f"{len(prompts)} held-out prompts, greedy, max_new_tokens {args.max_new_tokens}; "
          f"median of {args.rounds} interleaved rounds"
          f"{' (engines alive together)' if args.engines_alive_together else ''}; baseline {base_name}")
    print(f"{'conc':>5} {'variant':>9} {'tok/s':>8} {'vs ' + base_name:>10} {'accept len':>11} {'identical':>10}  rounds tok/s")
    rows = []
    for c in args.concurrency:
        base = statistics.median(x.output_tok_s for x in runs[base_name][c])
        for name in args.variants:
            rs = runs[name][c]
            tok_s = statistics.median(x.output_tok_s for x in rs)
            same = min(sum(a == b for a, b in zip(runs[base_name][c][0].output_ids, x.output_ids)) for x in rs)
            accept = rs[-1].accept_length or 0.0
            print(f"{c:>5} {name:>9} {tok_s:>8.1f} {tok_s / base:>9.2f}x {accept:>11.2f} {same:>5}/{len(prompts)}  "
                  + " ".join(f"{x.output_tok_s:.1f}" for x in rs))
            rows.append({"concurrency": c, "variant": name, "tok_s": tok_s, "vs_baseline": tok_s / base,
                         "rounds_tok_s": [x.output_tok_s for x in rs], "accept_length": accept,
                         "identical_outputs": same, "num_prompts": len(prompts)})
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


# ---------------------------------------------------------------------- DSPARK cap-accept


def fit_confidence_dspark(model_path: str, dflash_dir: str, out_dir: str, prompts, max_new: int) -> dict[str, float]:
    """Save ``dflash_dir`` as a DSPARK draft whose confidence head predicts each draft's acceptance.

    Static greedy decoding of ``prompts`` records, for every draft slot the verify judged (all drafts
    before it accepted), the draft's hidden row and whether it was accepted; a logistic regression on
    them gives ``confidence_head.proj``: P(draft k accepted | drafts before it accepted).
    """
    from safetensors.torch import load_file, save_file

    from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
    from sglite.srt.managers.scheduler import Scheduler
    from sglite.srt.runtime_context import ParallelState, scoped
    from sglite.srt.server_args import ServerArgs
    from sglite.srt.speculative.dflash_worker import create_dflash_worker
    from sglite.testing.runner_generate import scheduler_greedy_generate
    from sglite.testing.tiny_dflash import build_tiny_dspark_draft

    build_tiny_dspark_draft(out_dir, dflash_dir, markov_rank=8, markov_scale=0.0, sample_from_anchor=False,
                            enable_confidence_head=True, confidence_head_with_markov=False)
    sa = ServerArgs(model_path=model_path, speculative_algorithm="DSPARK", speculative_draft_model_path=out_dir,
                    device="cpu", disable_radix_cache=True, log_level="warning").validate()
    feats, labels, seen = [], [], {}
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            worker = create_dflash_worker(sa)
            propose, decode = worker.draft_model.propose_drafts, worker.forward_decode

            def recording_propose(out, fb, block):
                seen["hidden"] = out.hidden_states.reshape(fb.batch_size, block, -1)[:, 1:]  # the drafting rows
                return propose(out, fb, block)

            def recording_decode(batch):
                result = decode(batch)
                accepted = torch.tensor(worker.last_step.accept_lens)
                slot = torch.arange(seen["hidden"].shape[1])
                judged = slot[None, :] <= accepted[:, None]
                feats.append(seen["hidden"][judged])
                labels.append((slot[None, :] < accepted[:, None])[judged].float())
                return result

            worker.draft_model.propose_drafts, worker.forward_decode = recording_propose, recording_decode
            scheduler_greedy_generate(Scheduler(sa, worker), prompts, max_new)
        finally:
            destroy_parallel_runtime()
    x, y = torch.cat(feats).float(), torch.cat(labels)
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + 1e-3 * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    weights["confidence_head.proj.weight"] = w.detach()[None, :].contiguous()
    weights["confidence_head.proj.bias"] = b.detach().clone()
    save_file(weights, path)
    with torch.no_grad():
        pred = torch.sigmoid(x @ w + b) >= 0.5
    return {"fit_slots": int(y.numel()), "fit_accept_rate": float(y.mean()), "fit_accuracy": float((pred == y.bool()).float().mean())}


def bench_dspark_cap(args) -> int:
    """static vs cap-accept on a DSPARK draft with a fitted confidence head (module docstring)."""
    import tempfile

    import sglite
    from sglite.bench_offline import run_engine

    prompts = _heldout_prompts(args.model_path, args.prompt_set, args.num_prompts, args.seed)
    fit_prompts = _heldout_prompts(args.model_path, args.prompt_set, 2 * args.num_prompts, args.seed + 1)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    out_dir = tempfile.mkdtemp(prefix="dspark_conf_")
    fit = fit_confidence_dspark(args.model_path, args.draft_model_path, out_dir, fit_prompts, args.max_new_tokens)
    common = dict(model_path=args.model_path, device=args.device, attention_backend=args.attention_backend,
                  disable_radix_cache=True, log_level="warning", speculative_algorithm="DSPARK",
                  speculative_draft_model_path=out_dir)
    runs = [("static", None)] + [("cap-accept", t) for t in args.dspark_cap_thresholds]
    results = {}
    for mode, threshold in runs:
        extra = {"ragged_verify_mode": mode}
        if threshold is not None:
            extra["ragged_verify_cap_threshold"] = threshold
        engine = sglite.Engine(**common, **extra)
        try:
            run_engine(engine, prompts[:1], sampling, 1)  # warm-up
            results[(mode, threshold)] = {c: run_engine(engine, prompts, sampling, c) for c in args.concurrency}
        finally:
            engine.shutdown()
    with open(os.path.join(args.draft_model_path, "config.json")) as f:
        n_drafts = json.load(f)["block_size"] - 1  # DFlash slot convention: B-1 drafts per block

    def verify_tokens(res) -> int:
        """Target tokens verified: (anchor + drafts scored) per verify forward, from meta_info."""
        return int(sum(m["spec_verify_ct"] * (1 + (m.get("spec_cap_length") or n_drafts)) for m in res.meta_infos))

    print(f"DSPARK cap-accept on {args.model_path} + fitted DSPARK({args.draft_model_path}); device {args.device}; "
          f"{len(prompts)} held-out prompts, greedy, max_new_tokens {args.max_new_tokens}; {n_drafts} drafts per block")
    print(f"confidence head fit: {fit['fit_slots']} judged slots, accept rate {fit['fit_accept_rate']:.2f}, "
          f"accuracy {fit['fit_accuracy']:.2f}")
    print(f"{'conc':>5} {'mode':>16} {'tok/s':>8} {'accept len':>11} {'verify tok/step':>16} "
          f"{'verify tok':>11} {'saved':>7} {'identical':>10}")
    rows = []
    for c in args.concurrency:
        base = results[("static", None)][c]
        base_tokens = verify_tokens(base)
        for (mode, threshold), per_c in results.items():
            res = per_c[c]
            tokens = verify_tokens(res)
            same = sum(a == b for a, b in zip(base.output_ids, res.output_ids))
            label = mode if threshold is None else f"{mode}@{threshold:g}"
            saved = 1 - tokens / base_tokens
            print(f"{c:>5} {label:>16} {res.output_tok_s:>8.1f} {res.accept_length or 0:>11.2f} "
                  f"{tokens / res.verify_steps:>16.2f} {tokens:>11} {saved:>6.1%} {same:>5}/{len(prompts)}")
            rows.append({"concurrency": c, "mode": mode, "threshold": threshold, "tok_s": res.output_tok_s,
                         "accept_length": res.accept_length, "verify_tokens": tokens,
                         "verify_steps": res.verify_steps, "saved": saved, "identical_outputs": same, **fit})
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
