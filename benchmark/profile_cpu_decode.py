"""CPU time per decode step (and a torch.profiler op table) through the ModelRunner, and the GEMM layouts.

    python benchmark/profile_cpu_decode.py step --model-path DIR --batch-size 1 8 32 [--profile] [--no-pack | --pack-layout L]
        [--enable-torch-compile] [--dtype bfloat16]
    python benchmark/profile_cpu_decode.py compiled --model-path DIR --batch-size 8 32 [--prefill | --mixed] [--prompt-len L]
    python benchmark/profile_cpu_decode.py gemm --shapes 200m --rows 1 8 32 256 1024 [--copies 12] [--dtype bfloat16]
    python benchmark/profile_cpu_decode.py spec-disable --num-prompts 32 --output-len 48
    python benchmark/profile_cpu_decode.py spec-step [--enable-torch-compile]
    python benchmark/profile_cpu_decode.py context-write --rows 1 4 16 256

``step``: 32-token random prompts, one prefill, 12 decode steps; prints the median ``time.process_time``
per step (steady on a shared box, unlike wall time). ``--no-pack`` skips cpu_gemm's packed copies (the
before/after A/B); ``--pack-layout`` forces one of its two packs. ``compiled``: the --enable-torch-compile
graph against the eager forward on the same batches, alternated per step, with the largest logit difference
and greedy flips. ``gemm``: the model's four layer weight shapes (``--copies`` distinct copies of each, so
that a step's stream from memory is timed, not cached reads) and its LM head, one call each, best of 5
interleaved rounds: ``F.linear`` on the column-major weight, MKL packed (``mkl::_mkl_linear``), oneDNN packed (``mkldnn::_linear_pointwise``),
and up to 16 rows sglite's small-M kernel (``layers/cpu_small_m.py``); ``--dtype bfloat16``: ``F.linear`` and oneDNN's
pack only, in bf16.
``spec-step``: where a DFLASH step's CPU time goes at batch 1 on the default pair (random-token prompts,
greedy): the draft block, the target's verify, acceptance, the context K/V write, and the whole step.
``context-write``: the default draft's whole context K/V write (what a prompt, a drafted step's accepted rows and a
deferred catch-up cost the draft) per row count, through its fp32 weights and through the bf16 copies the server
takes from ``BF16_PROJECTION_MIN_ROWS`` rows on a CPU with bf16 dot products (``layers/cpu_bf16_projection.py``).
``spec-disable``: an in-process Scheduler on the toy pair (or
``--model-path`` / ``--draft-model-path``, e.g. the SmolLM2 GGUF and ``python/sglite/assets/smollm2_draft``),
greedy, plain vs DFLASH with ``--speculative-disable-by-batch-size 1`` (never drafts) vs DFLASH vs
``--speculative-adaptive`` (``--kinds``), CPU seconds for the whole run, alternated twice, outputs
compared. Run with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

SHAPES = {  # (in, out) of qkv, o, gate_up, down, LM head
    "200m": [(1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024), (1024, 32000)],
    "smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
}


# torch.profiler op names by where their self CPU time goes in a decode step.
OP_CATEGORIES = {
    "GEMM": ("mkl::_mkl_linear", "aten::mm", "aten::addmm", "aten::bmm"),
    "attention (SDPA, K/V gather and write)": (
        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select", "aten::index_copy_",
        "aten::_index_put_impl_",
    ),
    "views and allocations": (
        "aten::as_strided", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select",
        "aten::transpose", "aten::permute", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::to",
        "aten::alias", "aten::expand", "aten::unsqueeze", "aten::detach", "aten::t", "aten::contiguous",
    ),
}


def print_op_categories(events, profiled_s: float, steps: int) -> None:
    """Self CPU ms per step by category; what torch ops do not account for is Python (and profiler) time."""
    per = {k: 0.0 for k in OP_CATEGORIES}
    per["element-wise (norms, rotary, SiLU, residual, argmax, ...)"] = 0.0
    for e in events:
        if not e.key.startswith(("aten::", "mkl::")):
            continue
        cat = next((k for k, names in OP_CATEGORIES.items() if e.key in names), None)
        if cat is None and e.key in ("aten::scaled_dot_product_attention", "aten::linear", "aten::rms_norm",
                                     "aten::_fused_rms_norm", "aten::matmul"):
            continue  # wrappers: their self time is dispatch only, counted below as Python/other
        per[cat or "element-wise (norms, rotary, SiLU, residual, argmax, ...)"] += e.self_cpu_time_total / 1e3
    total_ms = profiled_s * 1e3
    per["outside torch ops (Python, wrappers, profiler)"] = total_ms - sum(per.values())
    for k, v in per.items():
        print(f"  {k:58s} {v / steps:8.1f} ms/step {100 * v / total_ms:5.1f}%")


def step(args: argparse.Namespace) -> None:
    """Median CPU ms per decode step per batch size (optionally with the profiler's top ops)."""
    import sglite.srt.model_executor.model_runner as mr
    from sglite.bench_offline import random_prompt_ids
    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.model_executor.forward_batch_info import ForwardMode
    from sglite.srt.server_args import ServerArgs

    if args.no_pack:
        mr.pack_weights_for_cpu = lambda model: None
    elif args.pack_layout != "auto":
        from sglite.srt.layers.cpu_gemm import pack_weights_for_cpu
        mr.pack_weights_for_cpu = lambda model: pack_weights_for_cpu(model, args.pack_layout)
    sa = ServerArgs(model_path=args.model_path, device="cpu", dtype=args.dtype,
                    enable_torch_compile=args.enable_torch_compile).validate()
    runner = mr.ModelRunner(sa)
    vocab = ModelConfig.from_path(args.model_path).vocab_size
    for bs in args.batch_size:
        rows = runner.req_to_token_pool.alloc(bs)
        prompts = random_prompt_ids(bs, 32, vocab, 0)
        t0 = time.process_time()
        out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)]))
        prefill = time.process_time() - t0
        nxt, seq, cpu = torch.argmax(out.next_token_logits, -1).tolist(), 32, []

        def one() -> None:
            nonlocal nxt, seq
            b = runner.build_forward_batch(ForwardMode.DECODE, [(r, seq, [t]) for r, t in zip(rows, nxt)])
            nxt = torch.argmax(runner.forward(b).next_token_logits, -1).tolist()
            seq += 1

        for _ in range(12):
            t0 = time.process_time()
            one()
            cpu.append(time.process_time() - t0)
        med = sorted(cpu)[len(cpu) // 2]
        print(f"bs {bs}: prefill {prefill * 1e3:.1f} ms CPU, decode step {med * 1e3:.1f} ms CPU ({bs / med:.1f} tok/s)")
        if args.profile:
            with torch.profiler.profile() as prof:
                t0 = time.process_time()
                for _ in range(3):
                    one()
                profiled = time.process_time() - t0
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            print_op_categories(prof.key_averages(), profiled, 3)
        runner.req_to_token_pool.free(rows)


def _both_ways(runner, eager, fb, i: int, cpu: dict[str, list[float]]) -> dict[str, torch.Tensor]:
    """``fb``'s logits compiled and eagerly, in an order that alternates with ``i``; each call's CPU time appended."""
    got = {}
    for kind in (("compiled", "eager") if i % 2 == 0 else ("eager", "compiled")):
        t = time.process_time()
        got[kind] = runner.compiled_decode.run(fb).next_token_logits if kind == "compiled" else eager(fb)
        cpu[kind].append(time.process_time() - t)
    return got


def _compiled_extend(runner, eager, reqs: list[tuple[int, int, list[int]]], reps: int, label: str) -> None:
    """``compiled --prefill / --mixed``: one EXTEND batch of (row, prefix, new tokens), through the token graph and
    eagerly, alternated."""
    from sglite.srt.model_executor.forward_batch_info import ForwardMode

    loc = runner.token_to_kv_pool_allocator.alloc(sum(len(new) for _, _, new in reqs))
    cpu: dict[str, list[float]] = {"compiled": [], "eager": []}
    diff = 0.0
    for i in range(reps):
        fb = runner.build_forward_batch(ForwardMode.EXTEND, reqs, out_cache_loc=loc)
        served = "compiled" if runner.compiled_decode.can_run(fb) else "eager"  # what a server would run
        got = _both_ways(runner, eager, fb, i, cpu)
        diff = max(diff, (got["compiled"] - got["eager"]).abs().max().item())
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in cpu.items()}
    print(f"bs {len(reqs)} {label}: eager {med['eager']:.1f} ms, compiled "
          f"{med['compiled']:.1f} ms CPU ({med['eager'] / med['compiled']:.3f}x); max |logit diff| {diff:.1e}; "
          f"the server runs it {served}")
    runner.token_to_kv_pool_allocator.free(loc)


def compiled(args: argparse.Namespace) -> None:
    """CPU ms per decode step (``--prefill``: per prefill; ``--mixed``: per mixed step), the compiled graph
    (--enable-torch-compile) vs the eager forward, same batches.

    One runner; each step runs both ways on the same slots (the eager forward rewrites the same K/V), in
    alternating order, and the logits are compared. Greedy continues from the eager logits.
    """
    from sglite.bench_offline import random_prompt_ids
    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.model_executor.forward_batch_info import ForwardMode
    from sglite.srt.model_executor.model_runner import ModelRunner
    from sglite.srt.server_args import ServerArgs

    t0 = time.perf_counter()
    sa = ServerArgs(model_path=args.model_path, device="cpu", dtype="float32", enable_torch_compile=True).validate()
    runner = ModelRunner(sa)
    print(f"start-up with compile: {time.perf_counter() - t0:.1f} s wall")
    vocab = ModelConfig.from_path(args.model_path).vocab_size

    def eager(fb):
        fb.attn_backend.init_forward_metadata(fb)
        return runner.model.forward(fb.input_ids, fb.positions, fb).next_token_logits

    with torch.inference_mode():
        for bs in args.batch_size:
            rows = runner.req_to_token_pool.alloc(bs)
            prompts = random_prompt_ids(bs, args.prompt_len, vocab, 0)
            if args.prefill or args.mixed:
                if args.prefill:
                    reqs, label = [(r, 0, p) for r, p in zip(rows, prompts)], f"prefill of {args.prompt_len} tokens"
                else:
                    # A mixed step as a server runs it: one new prompt beside bs - 1 decode rows at twice its keys
                    # (their K/V slots: whatever the pool holds; the timing does not depend on the values).
                    decode_keys = 2 * args.prompt_len
                    reqs = [(rows[0], 0, prompts[0])] + [(r, decode_keys - 1, p[:1]) for r, p in zip(rows[1:], prompts[1:])]
                    label = f"mixed step, one {args.prompt_len}-token prompt"
                _compiled_extend(runner, eager, reqs, args.steps, label)
                runner.req_to_token_pool.free(rows)
                continue
            out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)]))
            nxt, seq = torch.argmax(out.next_token_logits, -1).tolist(), args.prompt_len
            cpu = {"compiled": [], "eager": []}
            diff, flips = 0.0, 0
            for i in range(args.steps):
                fb = runner.build_forward_batch(ForwardMode.DECODE, [(r, seq, [t]) for r, t in zip(rows, nxt)])
                got = _both_ways(runner, eager, fb, i, cpu)
                diff = max(diff, (got["compiled"] - got["eager"]).abs().max().item())
                flips += int((got["compiled"].argmax(-1) != got["eager"].argmax(-1)).sum())
                nxt, seq = got["eager"].argmax(-1).tolist(), seq + 1
            med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in cpu.items()}
            print(f"bs {bs}: eager {med['eager']:.1f} ms, compiled {med['compiled']:.1f} ms CPU per step "
                  f"({med['compiled'] / med['eager'] - 1:+.0%}); max |logit diff| {diff:.1e}, "
                  f"argmax flips {flips} of {bs * args.steps}")
            runner.req_to_token_pool.free(rows)


def gemm(args: argparse.Namespace) -> None:
    """Per row count: the model's layer weight shapes (``--copies`` distinct copies of each) and its LM head, per layout."""
    dtype = getattr(torch, args.dtype)
    fp32 = dtype == torch.float32
    if args.gguf and not fp32:
        raise SystemExit("--gguf: the GGUF kernel computes in fp32 (drop --dtype bfloat16)")

    def layouts(w: torch.Tensor) -> dict:
        w = w.to(dtype)
        mkl = {"mkl": torch.ops.mkl._mkl_reorder_linear_weight(w, 32)} if fp32 else {}  # an sgemm pack
        return dict(cm=w.t().contiguous().t(), dnn=torch.ops.mkldnn._reorder_linear_weight(w, 32), ph=w, **mkl)

    from sglite.srt.layers.cpu_gguf_linear import GGUF_MAX_ROWS, gguf_kernel_available, gguf_linear
    from sglite.srt.layers.cpu_small_m import SMALL_M_MAX_ROWS, small_m_kernel

    small_m = small_m_kernel() if fp32 else None  # layers/cpu_small_m.py, fp32 rows 1..16 (None: cannot be built)
    gguf_types = dict(zip(("layers", "head"), args.gguf)) if args.gguf and gguf_kernel_available() else {}
    *layer_shapes, head_shape = SHAPES[args.shapes]

    def weight(n: int, k: int, group: str) -> dict:
        w = torch.randn(n, k) * 0.02
        if group not in gguf_types:
            return layouts(w)
        # The GGUF kernel reads the blocks; the other layouts the same weights dequantized (as the loader gives them).
        import gguf

        qtype = gguf.GGMLQuantizationType[gguf_types[group]]
        blocks = gguf.quants.quantize(w.numpy(), qtype)
        d = layouts(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
        d["gguf"] = (torch.from_numpy(blocks.copy()), int(qtype))
        return d

    groups = {"layers": [(k, weight(n, k, "layers")) for _ in range(args.copies) for k, n in layer_shapes],
              "head": [(head_shape[0], weight(head_shape[1], head_shape[0], "head"))]}
    for m in args.rows:
        xs = {k: torch.randn(m, k, dtype=dtype) for k, _ in layer_shapes + [head_shape]}
        cells = []
        for group, weights in groups.items():
            best = {"column-major": [], "mkl-packed": [], "onednn-packed": []}
            if not fp32:
                del best["mkl-packed"]  # an sgemm pack
            if small_m is not None and m <= SMALL_M_MAX_ROWS:
                best["small-m"] = []
            if group in gguf_types and m <= GGUF_MAX_ROWS:
                best[f"gguf-{gguf_types[group]}"] = []
            for _ in range(5):
                for meth in best:
                    t0 = time.process_time()
                    for k, d in weights:
                        if meth == "column-major":
                            F.linear(xs[k], d["cm"])
                        elif meth == "mkl-packed":
                            torch.ops.mkl._mkl_linear(xs[k], d["mkl"], d["ph"], None, m)
                        elif meth == "onednn-packed":
                            torch.ops.mkldnn._linear_pointwise(xs[k], d["dnn"], None, "none", [], "")
                        elif meth.startswith("gguf-"):
                            gguf_linear(xs[k], *d["gguf"], None)
                        else:  # on the layouts sglite keeps: column-major layers, the tied head's row-major embedding
                            small_m(xs[k], d["cm"] if group == "layers" else d["ph"])
                    best[meth].append(time.process_time() - t0)
            cells.append(f"{group}: " + " ".join(f"{meth} {min(v) * 1e3:.1f}" for meth, v in best.items()))
        print(f"M {m:>5} (ms)  " + "  |  ".join(cells), flush=True)


def spec_step(args: argparse.Namespace) -> None:
    """CPU ms per part of a DFLASH step at batch 1 on the default pair: draft block, verify, accept, context write."""
    from sglite.srt.default_model import DEFAULT_DRAFT_DIR, default_model_path
    from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
    from sglite.srt.managers.scheduler import Scheduler
    from sglite.srt.runtime_context import ParallelState, scoped
    from sglite.srt.server_args import ServerArgs
    from sglite.srt.speculative.dflash_worker import create_dflash_worker
    from sglite.testing.runner_generate import scheduler_greedy_generate

    sa = ServerArgs(model_path=args.model_path or default_model_path(), speculative_algorithm="DFLASH",
                    speculative_draft_model_path=args.draft_model_path or DEFAULT_DRAFT_DIR, device="cpu",
                    enable_torch_compile=args.enable_torch_compile,
                    speculative_token_map=args.speculative_token_map,
                    speculative_num_draft_tokens=args.speculative_num_draft_tokens,
                    speculative_draft_model_quantization=args.speculative_draft_model_quantization).validate()
    totals: dict[str, list[float]] = {}

    def timed(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.process_time()
            out = fn(*a, **kw)
            totals.setdefault(label, []).append(time.process_time() - t0)
            return out

        setattr(obj, name, wrapper)

    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            worker = create_dflash_worker(sa)
            sched = Scheduler(sa, worker)
            scheduler_greedy_generate(sched, [list(range(300, 340))], 8)  # warm-up
            timed(worker, "_decode_with_draft", "whole drafted step")
            timed(worker.draft_runner, "forward", "draft block forward (layers + head)")
            timed(worker.draft_model, "propose_drafts", "propose drafts")
            timed(worker.target_runner, "forward", "target verify forward")
            timed(worker, "_verify", "accept")
            timed(worker, "_write_context", "context K/V write")
            for i in range(args.num_prompts):  # one request at a time: batch 1
                scheduler_greedy_generate(sched, [list(range(200 + 7 * i, 240 + 7 * i))], args.output_len)
        finally:
            destroy_parallel_runtime()
    print(f"DFLASH step at batch 1, {'compiled' if args.enable_torch_compile else 'eager'}: median CPU ms per call")
    for label, ts in totals.items():
        print(f"  {label:<38} {sorted(ts)[len(ts) // 2] * 1e3:7.1f}  ({len(ts)} calls)")


def spec_disable(args: argparse.Namespace) -> None:
    """CPU seconds of plain / DFLASH-with-drafting-disabled / DFLASH schedulers on the same greedy prompts."""
    from sglite.bench_offline import random_prompt_ids
    from sglite.srt.default_model import TOY_DRAFT_DIR, TOY_MODEL_DIR
    from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
    from sglite.srt.managers.scheduler import Scheduler
    from sglite.srt.managers.tp_worker import TpModelWorker
    from sglite.srt.runtime_context import ParallelState, scoped
    from sglite.srt.server_args import ServerArgs
    from sglite.srt.speculative.dflash_worker import create_dflash_worker
    from sglite.testing.runner_generate import scheduler_greedy_generate

    prompts = random_prompt_ids(args.num_prompts, 64, 4000, 0)

    def run(kind: str) -> tuple[float, list]:
        kw = dict(model_path=args.model_path or TOY_MODEL_DIR, device="cpu", dtype="float32", max_running_requests=64,
                  enable_torch_compile=args.enable_torch_compile)
        if kind != "plain":
            kw.update(speculative_algorithm="DFLASH", speculative_draft_model_path=args.draft_model_path or TOY_DRAFT_DIR,
                      speculative_adaptive=kind == "adaptive")
        if kind == "disabled":
            kw["speculative_disable_by_batch_size"] = 1
        sa = ServerArgs(**kw).validate()
        with scoped(parallel=ParallelState(tp_size=1)):
            try:
                worker = TpModelWorker.create(sa) if kind == "plain" else create_dflash_worker(sa)
                sched = Scheduler(sa, worker)
                scheduler_greedy_generate(sched, prompts[:2], 4)  # warm-up
                t0 = time.process_time()
                out = scheduler_greedy_generate(sched, prompts, args.output_len)
                return time.process_time() - t0, out
            finally:
                destroy_parallel_runtime()

    kinds = args.kinds
    secs: dict[str, list[float]] = {k: [] for k in kinds}
    outs = {}
    for _ in range(2):
        for k in kinds:
            t, outs[k] = run(k)
            secs[k].append(t)
    for k in kinds:
        print(f"{k:>9}: {' '.join(f'{t:.2f}' for t in secs[k])} CPU s; same tokens as {kinds[0]}: {outs[k] == outs[kinds[0]]}")


def context_write(args: argparse.Namespace) -> None:
    """Microseconds of the default draft's whole context K/V write per row count, fp32 route vs bf16 copies."""
    import sglite.srt.layers.cpu_bf16_projection as bf16_projection
    from sglite.srt.default_model import DEFAULT_DRAFT_DIR, default_model_path
    from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
    from sglite.srt.runtime_context import ParallelState, scoped
    from sglite.srt.server_args import ServerArgs
    from sglite.srt.speculative.dflash_worker import create_dflash_worker

    sa = ServerArgs(model_path=args.model_path or default_model_path(), speculative_algorithm="DFLASH",
                    speculative_draft_model_path=DEFAULT_DRAFT_DIR, device="cpu").validate()
    shipped_min_rows = bf16_projection.BF16_PROJECTION_MIN_ROWS
    with scoped(parallel=ParallelState(tp_size=1)), torch.inference_mode():
        try:
            worker = create_dflash_worker(sa)
            draft, pool = worker.draft_model, worker.draft_runner.token_to_kv_pool
            if draft.fc_bf16 is None:
                draft.project_context_in_bf16()  # not native here: timed anyway, through oneDNN's emulation
                print("note: this CPU has no bf16 dot products; the server keeps the fp32 route")
            width = len(draft.target_layer_ids) * draft.config.hidden_size
            print(f"whole context K/V write of the default draft ({len(draft.layers)} layers, {width}-wide features), "
                  f"best of 3 x {args.calls} calls; the server takes the bf16 copies from {shipped_min_rows} rows")
            print(f"{'rows':>5} {'fp32 us':>9} {'bf16 us':>9} {'bf16/fp32':>10} {'fp32 us/row':>12} {'bf16 us/row':>12}")
            for rows in args.rows:
                feats = torch.randn(rows, width) * 20
                positions, slots = torch.arange(rows) + 16, torch.arange(rows) + 1

                def best_us(min_rows: int) -> float:
                    bf16_projection.BF16_PROJECTION_MIN_ROWS = min_rows  # which route fuse_context / context_kv take
                    for _ in range(5):
                        draft.write_context_kv(feats, positions, slots, pool)
                    rounds = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            draft.write_context_kv(feats, positions, slots, pool)
                        rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
                    return min(rounds)

                fp32, bf16 = best_us(1 << 62), best_us(1)
                print(f"{rows:>5} {fp32:>9.0f} {bf16:>9.0f} {bf16 / fp32:>10.2f} {fp32 / rows:>12.1f} {bf16 / rows:>12.1f}")
        finally:
            bf16_projection.BF16_PROJECTION_MIN_ROWS = shipped_min_rows
            destroy_parallel_runtime()


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the sub-command and run it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("--model-path", required=True)
    s.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    s.add_argument("--profile", action="store_true")
    s.add_argument("--no-pack", action="store_true")
    s.add_argument("--enable-torch-compile", action="store_true", help="decode through the compiled graph")
    s.add_argument("--pack-layout", choices=("auto", "onednn", "mkl"), default="auto",
                   help="cpu_gemm's packed copies in this layout (auto: the start-up probe's choice)")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype (--dtype)")
    c = sub.add_parser("compiled")
    c.add_argument("--model-path", required=True)
    c.add_argument("--batch-size", type=int, nargs="+", default=[8, 32])
    c.add_argument("--steps", type=int, default=12)
    c.add_argument("--prompt-len", type=int, default=32, help="tokens a prompt (--prefill, --mixed; decode's prefix)")
    c.add_argument("--prefill", action="store_true", help="time equal-length prefills of --prompt-len tokens (the token graph)")
    c.add_argument("--mixed", action="store_true",
                   help="time mixed steps: one --prompt-len prompt beside batch - 1 decode rows (the token graph)")
    g = sub.add_parser("gemm")
    g.add_argument("--shapes", choices=sorted(SHAPES), default="200m")
    g.add_argument("--gguf", nargs=2, metavar=("LAYERS_TYPE", "HEAD_TYPE"),
                   help="also time the GGUF kernel on blocks of these types (SmolLM2's file: Q4_1 Q8_0); every "
                        "layout then holds the same weights, dequantized")
    g.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 1024])
    g.add_argument("--copies", type=int, default=1,
                   help="distinct copies of each layer shape: 1 = cache-warm, the layer count = streamed as a step")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and inputs")
    t = sub.add_parser("spec-step")
    t.add_argument("--model-path", default=None, help="target; default: the default model's GGUF")
    t.add_argument("--draft-model-path", default=None, help="default: the default draft")
    t.add_argument("--enable-torch-compile", action="store_true")
    t.add_argument("--speculative-token-map", default=None, help="draft head over these token ids only (.pt)")
    t.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="B (the verify's width); default: the checkpoint's (`sglite serve` uses 3 on CPU for the bundled draft)")
    t.add_argument("--speculative-draft-model-quantization", choices=("q8_0", "none"), default=None,
                   help="q8_0: the draft's linears as Q8_0 blocks through the GGUF kernel")
    t.add_argument("--num-prompts", type=int, default=3)
    t.add_argument("--output-len", type=int, default=48)
    d = sub.add_parser("spec-disable")
    d.add_argument("--num-prompts", type=int, default=32)
    d.add_argument("--output-len", type=int, default=48)
    d.add_argument("--model-path", default=None, help="target (directory or .gguf); default: the toy model")
    d.add_argument("--draft-model-path", default=None, help="DFLASH draft; default: the toy draft")
    d.add_argument("--kinds", nargs="+", default=["plain", "disabled", "dflash"],
                   choices=("plain", "disabled", "dflash", "adaptive"))
    d.add_argument("--enable-torch-compile", action="store_true", help="every kind with the flag")
    w = sub.add_parser("context-write")
    w.add_argument("--model-path", default=None, help="target; default: the default model's GGUF")
    w.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 64, 256])
    w.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    {"step": step, "compiled": compiled, "gemm": gemm, "spec-disable": spec_disable, "spec-step": spec_step,
     "context-write": context_write}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
