"""ServerArgs: the one dataclass behind every CLI flag, with validation before anything loads.

The argparse parser is generated from the dataclass fields (flag = ``--`` + name with dashes), so
a new option is one field with its help text. ``validate()`` raises ``ServerArgsError`` with one
line naming the flag to change; ``from_cli`` turns that into ``parser.error`` (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from sglite.srt.runtime_context import derive_attention_widths

SPECULATIVE_ALGORITHMS = ("DFLASH", "DSPARK", "EAGLE", "STANDALONE")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "fake")
DEVICES = ("cpu", "cuda")
# --speculative-draft-model-quantization (SGLang's flag): "none" keeps the draft's own weights (a way to turn off a default).
DRAFT_MODEL_QUANTIZATIONS = ("q8_0", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
SCHEDULE_POLICIES = ("lpm", "fcfs")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "follow_bootstrap_room")
RAGGED_VERIFY_MODES = ("static", "cap-accept")  # SGLang's names (its "compact" packs ragged windows)
LOAD_FORMATS = ("auto", "safetensors", "gguf")
# A prompt's prefill on CPU spans several decode steps. A 64-token share per mixed step kept ITL p99/p50 at
# 2.3-3.2x under Poisson arrivals on SmolLM2 (32: 1.7-1.8x, 256: 5-6x); docs/benchmarks.md, "Serving stalls".
# Under a burst, two prompts a step put TTFT p99 at 5.9 s at concurrency 32, so the default share grows with
# waiting-per-decoding requests (schedule_policy.mixed_prefill_share): TTFT p99 5.2-5.5 -> 2.9-3.6 CPU s in a
# replay, Poisson ITL p99/p50 unchanged (docs/benchmarks.md, "Mixed steps").
CPU_MIXED_CHUNK_PREFILL_SIZE = 64


class ServerArgsError(ValueError):
    """An invalid flag value or combination; the message names the flag to change."""


def _opt(help: str, default: Any = None, choices: Optional[Sequence[Any]] = None, **kw: Any) -> Any:
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if "default_factory" in kw:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ServerArgs:
    """All server options; SGLang's flag names where SGLang has the option."""

    # Model and tokenizer. model_path None = the embedded default model shipped with the package.
    model_path: Optional[str] = _opt(
        "Model directory (config.json + safetensors), or a .gguf file / a folder holding one; default: the embedded model"
    )
    load_format: str = _opt("Checkpoint format; auto = gguf for a .gguf file (or a folder with one), else safetensors", "auto", LOAD_FORMATS)
    tokenizer_path: Optional[str] = _opt("Tokenizer directory; default: --model-path")
    served_model_name: Optional[str] = _opt("Model name reported by the OpenAI API; default: --model-path")
    chat_template: Optional[str] = _opt(
        "Chat template for /v1/chat/completions: a Jinja file, a JSON file with 'chat_template', or a built-in "
        "name (chatml); default: the tokenizer's own"
    )
    context_length: Optional[int] = _opt("Maximum context length; default: the model's max_position_embeddings")
    dtype: str = _opt("Weight and activation dtype", "auto", DTYPES)
    device: Optional[str] = _opt("Device; default: cuda when available, else cpu", None, DEVICES)
    random_seed: int = _opt("Random seed for sampling without a per-request seed", 0)
    cpu_threads: Optional[int] = _opt(
        "Compute (OpenMP) threads per scheduler rank on CPU; default: the rank's CPUs in SGLANG_CPU_OMP_THREADS_BIND, "
        "else this machine's CPUs less one for the front end, over the scheduler ranks; without a CPU list each rank "
        "is pinned to its own CPUs when a CPU is left over for the front end (managers/cpu_threads.py)"
    )

    # HTTP server.
    host: str = _opt("HTTP host", "127.0.0.1")
    port: int = _opt("HTTP port", 30000)
    api_key: Optional[str] = _opt("Require 'Authorization: Bearer <key>' (health and metrics stay public)")
    enable_metrics: bool = _opt("Expose Prometheus metrics on /metrics", False)
    log_level: str = _opt("Logging level", "info", LOG_LEVELS)
    max_request_body_bytes: Optional[int] = _opt(
        "Largest request body in bytes (413 above); default: 64 bytes per token of the context length, at least 1 MiB"
    )
    request_body_timeout: float = _opt("Seconds a client has to send a whole request body (408 after)", 30.0)
    trust_request_chat_template: bool = _opt(
        "Render chat templates sent in requests (`chat_template`), each in a worker killed after 5 s; "
        "without this flag they are refused with 400", False,
    )
    decode_log_interval: int = _opt("Log a 'Decode batch.' stats line every this many decode steps (SGLang's)", 40)

    # Parallelism.
    tp_size: int = _opt("Tensor-parallel size", 1)
    dp_size: int = _opt("Data-parallel size", 1)
    enable_dp_attention: bool = _opt("Run attention data-parallel (attn_tp = tp / dp) and the MLP at tp", False)
    attn_cp_size: int = _opt("Attention context-parallel size", 1)
    pp_size: int = _opt("Pipeline-parallel size (only 1 is supported)", 1)
    ep_size: int = _opt("MoE experts split over this many ranks of the TP group (dividing --tp-size); the rest of "
                        "the TP width splits each expert", 1)
    dist_init_addr: Optional[str] = _opt(
        "host:port of node 0 for torch.distributed rendezvous (and, with --nnodes > 1, the base port of the "
        "front ends' TCP endpoints: port+1 ...); default: a free local port"
    )
    nnodes: int = _opt("Nodes one server spans; each runs its share of the scheduler ranks (SGLang's flag)", 1)
    node_rank: int = _opt("This node's index in 0..--nnodes-1; node 0 serves HTTP, the others run schedulers only", 0)
    dist_timeout: int = _opt("Seconds before a distributed init or collective gives up", 60)
    load_balance_method: Optional[str] = _opt(
        "How the data-parallel controller picks a DP group per request; default: follow_bootstrap_room on a PD "
        "prefill node (group = bootstrap_room mod dp, which the decode node computes too), else round_robin",
        None, LOAD_BALANCE_METHODS,
    )

    # Memory and scheduling.
    kv_cache_dtype: str = _opt("KV cache dtype", "auto", KV_CACHE_DTYPES)
    mem_fraction_static: float = _opt("Fraction of device memory for weights + KV pools (CUDA)", 0.85)
    cpu_kv_cache_budget_mb: int = _opt("KV-pool byte budget on CPU, in MiB (CPU has no memory profile)", 256)
    max_total_tokens: Optional[int] = _opt("Upper bound on KV-pool tokens (only lowers the planned capacity)")
    max_running_requests: Optional[int] = _opt("Maximum concurrently running requests")
    max_queued_requests: Optional[int] = _opt("Requests a scheduler keeps waiting; over it a new one is a 503 with Retry-After")
    page_size: int = _opt("Tokens per KV page", 1)
    chunked_prefill_size: int = _opt("Maximum prefill tokens per forward (-1 disables chunking)", 2048)
    schedule_policy: str = _opt("Waiting-queue order: longest prefix match or first come first served", "lpm", SCHEDULE_POLICIES)
    enable_mixed_chunk: Optional[bool] = _opt(
        "Run decoding requests inside prefill batches (not with speculative decoding), so arriving prompts do not "
        "stall them. Bare flag = on; 'false' = off. Default: on for CPU, off for CUDA"
    )
    mixed_chunk_prefill_size: Optional[int] = _opt(
        "Prefill tokens a mixed batch carries besides its decoding requests: bounds the inter-token gap a prompt "
        f"adds. Default: {CPU_MIXED_CHUNK_PREFILL_SIZE} on CPU, times the waiting requests per decoding one once 4 "
        "wait (rounded down, at least 1: grows under a burst); --chunked-prefill-size on CUDA. Set, it is a fixed share"
    )
    disable_radix_cache: bool = _opt("Disable the radix prefix cache", False)
    attention_backend: Optional[str] = _opt("Attention backend; default: triton on CUDA, torch_native on CPU", None, ATTENTION_BACKENDS)
    disable_cuda_graph: bool = _opt("Disable CUDA graphs (decode, DFLASH verify and draft block run eagerly)", False)
    cuda_graph_max_bs: int = _opt(
        "Largest batch (requests) captured in a CUDA graph; buckets 1, 2, 4, 8, then multiples of 8", 32
    )
    enable_torch_compile: bool = _opt(
        "CPU: run decode steps, prefills, mixed steps and a DFLASH target's verify blocks through torch.compile "
        "(Inductor) graphs of the model (fused norms and rotary, paged attention through the slot table), compiled "
        "at start-up (~80 s on 2 cores, less when cached). TP 1, Llama-family models",
        False
    )
    torch_compile_max_bs: int = _opt(
        "Largest batch (requests) the compiled graphs run; larger ones run eagerly", 32
    )

    # Speculative decoding.
    speculative_algorithm: Optional[str] = _opt("Speculative decoding algorithm", None, SPECULATIVE_ALGORITHMS)
    speculative_draft_model_path: Optional[str] = _opt("Draft model directory")
    speculative_num_draft_tokens: Optional[int] = _opt(
        "Tokens verified per step (DFLASH: the block size B; DSPARK: B+1); default: from the checkpoint's block_size"
    )
    speculative_dspark_block_size: Optional[int] = _opt("DSPARK draft block size B; default: the checkpoint's")
    speculative_num_steps: Optional[int] = _opt("Draft steps (EAGLE/STANDALONE)")
    speculative_disable_by_batch_size: Optional[int] = _opt(
        "DFLASH/DSPARK: decode steps with at least this many running requests skip the draft (the target decodes "
        "alone and still fills the draft's context KV); drafting resumes when the batch shrinks. Default: always draft"
    )
    speculative_adaptive: Optional[bool] = _opt(
        "DFLASH/DSPARK: measure drafted and draft-free decode steps per batch size and draft only while it pays "
        "(tokens per second, with a small margin; the path not taken is still probed now and then). Greedy output is "
        "unchanged. Bare flag = on; 'false' = off. Default: on for the embedded default model pair, off otherwise"
    )
    speculative_draft_model_quantization: Optional[str] = _opt(
        "DFLASH/DSPARK on CPU: q8_0 rounds the draft's linear weights to GGUF Q8_0 blocks at load, which the GGUF "
        "kernel reads at decode sizes (about a quarter of the fp32 bytes a draft block streams), and on a CPU with "
        "bf16 dot products its context writes of 4+ rows project in bf16. Output is unchanged "
        "(the target verifies every draft). Default: q8_0 for the bundled draft on a CPU whose GGUF kernel is built, "
        "none otherwise",
        None, DRAFT_MODEL_QUANTIZATIONS,
    )
    speculative_token_map: Optional[str] = _opt(
        "DFLASH/DSPARK: a torch.save file of hot token ids (SGLang's FR-Spec map); the draft proposes only those "
        "tokens, through just their rows of the LM head. Output is unchanged. Default: the full vocabulary "
        "(the embedded default pair ships a map)"
    )
    speculative_draft_kv_cache_dtype: Optional[str] = _opt("Draft KV cache dtype; default: --kv-cache-dtype", None, KV_CACHE_DTYPES)
    speculative_draft_attention_backend: Optional[str] = _opt("Draft attention backend; default: --attention-backend", None, ATTENTION_BACKENDS)
    # SGLang selects the DSPARK verify mode with the environment variable SGLANG_RAGGED_VERIFY_MODE;
    # sglite reads it as this flag's default (resolved once, here).
    ragged_verify_mode: str = _opt(
        "DSPARK verify mode: static (verify every draft) or cap-accept (cut the block where the confidence "
        "head's predicted acceptance drops below --ragged-verify-cap-threshold); default: $SGLANG_RAGGED_VERIFY_MODE or static",
        default_factory=lambda: os.environ.get("SGLANG_RAGGED_VERIFY_MODE") or "static",
    )
    ragged_verify_cap_threshold: float = _opt("cap-accept: least predicted survival probability of a verified draft", 0.5)

    # PD disaggregation.
    disaggregation_mode: str = _opt("Prefill/decode disaggregation role", "null", DISAGGREGATION_MODES)
    disaggregation_bootstrap_port: int = _opt("Bootstrap server port on the prefill node", 8998)
    disaggregation_transfer_backend: str = _opt("KV transfer backend", "mooncake", TRANSFER_BACKENDS)
    disaggregation_decode_extra_slots: int = _opt("Extra request rows on a decode node for pre-allocation", 8)
    num_reserved_decode_tokens: int = _opt("KV tokens a decode node reserves per request beyond the prompt", 512)
    disaggregation_transfer_timeout: float = _opt("Seconds a decode node waits for a room's KV before failing it", 300.0)

    # ------------------------------------------------------------------ validation
    def one_rank_per_scheduler(self) -> bool:
        """Whether each scheduler drives a single rank (--tp-size 1, --attn-cp-size 1).

        --speculative-adaptive needs it: every rank would time its own steps and could choose a drafted
        or draft-free step apart from its peers, whose collectives must match step for step.
        """
        return self.tp_size == 1 and self.attn_cp_size == 1

    def validate(self) -> "ServerArgs":
        """Check every rule that can be checked before a model loads; raise ServerArgsError."""
        _require(self.tp_size >= 1, "--tp-size must be >= 1")
        _require(self.dp_size >= 1, "--dp-size must be >= 1")
        _require(self.attn_cp_size >= 1, "--attn-cp-size must be >= 1")
        _require(self.nnodes >= 1, "--nnodes must be >= 1")
        _require(0 <= self.node_rank < self.nnodes, f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1:
            _require(
                self.dist_init_addr is not None and host_port(self.dist_init_addr) is not None,
                "--nnodes > 1 needs --dist-init-addr host:port of node 0 (every node passes the same one)",
            )
            _require(
                self.dp_size == 1 or self.enable_dp_attention,
                "--nnodes > 1 spans one torch world: use --tp-size (with --enable-dp-attention for --dp-size > 1), "
                "not DP replicas",
            )
            _require(
                self.tp_size % self.nnodes == 0,
                f"--tp-size {self.tp_size} must be divisible by --nnodes {self.nnodes} (each node runs tp/nnodes ranks)",
            )
        _require(
            self.ep_size >= 1 and self.tp_size % self.ep_size == 0,
            f"--ep-size {self.ep_size} must be >= 1 and divide --tp-size {self.tp_size} (experts split within the TP group)",
        )
        _require(
            self.pp_size == 1,
            f"--pp-size {self.pp_size} is not supported: sglite has no pipeline parallelism; use --tp-size",
        )
        if self.enable_dp_attention:
            _require(self.dp_size > 1, "--enable-dp-attention needs --dp-size > 1")
            _require(
                self.tp_size % self.dp_size == 0,
                f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size} with --enable-dp-attention",
            )
        try:
            derive_attention_widths(self.tp_size, self.dp_size, self.enable_dp_attention, self.attn_cp_size)
        except ValueError as e:
            raise ServerArgsError(f"{e}; change --tp-size, --dp-size or --attn-cp-size") from None
        _require(
            isinstance(self.mem_fraction_static, (int, float))
            and math.isfinite(self.mem_fraction_static)
            and 0.0 < self.mem_fraction_static < 1.0,
            f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}",
        )
        _require(self.cpu_threads is None or self.cpu_threads >= 1, "--cpu-threads must be >= 1")
        _require(self.page_size >= 1, "--page-size must be >= 1")
        _require(self.decode_log_interval >= 1, "--decode-log-interval must be >= 1")
        _require(self.cuda_graph_max_bs >= 1, "--cuda-graph-max-bs must be >= 1 (use --disable-cuda-graph to turn graphs off)")
        _require(self.torch_compile_max_bs >= 2, "--torch-compile-max-bs must be >= 2 (batch 1 always runs eagerly)")
        if self.enable_torch_compile:
            _require(self.device != "cuda", "--enable-torch-compile is CPU only (CUDA decode uses CUDA graphs)")
            _require(
                self.tp_size == 1 and not self.enable_dp_attention,
                "--enable-torch-compile needs --tp-size 1 without --enable-dp-attention",
            )
            _require(
                not self.kv_cache_dtype.startswith("fp8"),
                "--enable-torch-compile does not take an fp8 --kv-cache-dtype (the compiled attention reads K/V "
                "stored in the model dtype)",
            )
        _require(self.cpu_kv_cache_budget_mb > 0, "--cpu-kv-cache-budget-mb must be > 0")
        _require(self.max_queued_requests is None or self.max_queued_requests >= 1, "--max-queued-requests must be >= 1")
        _require(self.max_total_tokens is None or self.max_total_tokens > 0, "--max-total-tokens must be > 0")
        _require(
            self.max_running_requests is None or self.max_running_requests > 0,
            "--max-running-requests must be > 0",
        )
        _require(self.context_length is None or self.context_length > 0, "--context-length must be > 0")
        _require(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size,
            "--chunked-prefill-size must be -1 (off) or >= --page-size",
        )
        _require(
            self.mixed_chunk_prefill_size is None or self.mixed_chunk_prefill_size >= self.page_size,
            "--mixed-chunk-prefill-size must be >= --page-size",
        )
        for flag, value, allowed in (
            ("--dtype", self.dtype, DTYPES),
            ("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            ("--speculative-draft-kv-cache-dtype", self.speculative_draft_kv_cache_dtype, KV_CACHE_DTYPES + (None,)),
            ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS + (None,)),
            ("--speculative-algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS + (None,)),
            ("--disaggregation-mode", self.disaggregation_mode, DISAGGREGATION_MODES),
            ("--disaggregation-transfer-backend", self.disaggregation_transfer_backend, TRANSFER_BACKENDS),
            ("--device", self.device, DEVICES + (None,)),
            ("--load-balance-method", self.load_balance_method, LOAD_BALANCE_METHODS + (None,)),
        ):
            _require(value in allowed, f"{flag} {value!r} is unknown; choose one of {[a for a in allowed if a]}")
        _require(
            not (self.disaggregation_mode == "prefill" and self.dp_size > 1
                 and self.resolved_load_balance_method() != "follow_bootstrap_room"),
            "a PD prefill node with --dp-size > 1 needs --load-balance-method follow_bootstrap_room (the decode node "
            "finds a request's prefill group as bootstrap_room % dp)",
        )
        algo = self.speculative_algorithm
        if algo in SPECULATIVE_ALGORITHMS:
            _require(
                self.speculative_draft_model_path is not None,
                f"--speculative-algorithm {algo} needs --speculative-draft-model-path",
            )
        if algo is None:
            _require(
                self.speculative_draft_model_path is None,
                "--speculative-draft-model-path is set but --speculative-algorithm is not",
            )
        # No --model-path: the embedded default pair, a DFLASH draft (default_model.resolve_default_model).
        block_draft = algo in ("DFLASH", "DSPARK") or (algo is None and self.model_path is None)
        if self.speculative_disable_by_batch_size is not None:
            _require(self.speculative_disable_by_batch_size >= 1, "--speculative-disable-by-batch-size must be >= 1")
            _require(block_draft, "--speculative-disable-by-batch-size needs --speculative-algorithm DFLASH or DSPARK")
        if self.speculative_adaptive:
            _require(block_draft, "--speculative-adaptive needs --speculative-algorithm DFLASH or DSPARK")
            _require(
                self.one_rank_per_scheduler(),
                "--speculative-adaptive needs --tp-size 1 and --attn-cp-size 1 (use --speculative-disable-by-batch-size)",
            )
        if self.speculative_draft_model_quantization not in (None, "none"):
            _require(
                block_draft,
                "--speculative-draft-model-quantization needs --speculative-algorithm DFLASH or DSPARK",
            )
            _require(
                self.resolved_device() == "cpu",
                f"--speculative-draft-model-quantization {self.speculative_draft_model_quantization} is a CPU option "
                "(the GGUF kernel); drop it on CUDA",
            )
        if self.speculative_token_map is not None:
            _require(block_draft, "--speculative-token-map needs --speculative-algorithm DFLASH or DSPARK")
            _require(
                os.path.isfile(self.speculative_token_map),
                f"--speculative-token-map {self.speculative_token_map}: no such file (sglite downloads nothing)",
            )
        if self.speculative_num_draft_tokens is not None:
            _require(self.speculative_num_draft_tokens >= 1, "--speculative-num-draft-tokens must be >= 1")
        if self.speculative_dspark_block_size is not None:
            _require(algo == "DSPARK", "--speculative-dspark-block-size needs --speculative-algorithm DSPARK")
            _require(self.speculative_dspark_block_size >= 1, "--speculative-dspark-block-size must be >= 1")
        _require(
            self.ragged_verify_mode in RAGGED_VERIFY_MODES,
            f"--ragged-verify-mode (SGLANG_RAGGED_VERIFY_MODE) {self.ragged_verify_mode!r} is unknown; "
            f"choose one of {list(RAGGED_VERIFY_MODES)}",
        )
        _require(
            self.ragged_verify_mode == "static" or algo == "DSPARK",
            f"--ragged-verify-mode {self.ragged_verify_mode} needs --speculative-algorithm DSPARK (a confidence head)",
        )
        _require(
            0.0 < self.ragged_verify_cap_threshold < 1.0, "--ragged-verify-cap-threshold must be in (0, 1)"
        )
        if self.attention_backend == "flashinfer" and self.resolved_device() != "cuda":
            raise ServerArgsError("--attention-backend flashinfer needs CUDA; use triton or torch_native on CPU")
        _require(1 <= self.port <= 65535, f"--port {self.port} is out of range")
        _require(
            self.max_request_body_bytes is None or self.max_request_body_bytes > 0,
            "--max-request-body-bytes must be > 0",
        )
        _require(
            math.isfinite(self.request_body_timeout) and self.request_body_timeout > 0,
            "--request-body-timeout must be a number of seconds > 0",
        )
        return self

    # ------------------------------------------------------------------ derived values
    def resolved_device(self) -> str:
        """The device to run on: the flag, else cuda when available, else cpu."""
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def num_scheduler_ranks(self) -> int:
        """Scheduler processes of the server: --tp-size per DP replica, or --tp-size in all with DP attention."""
        return self.tp_size if self.enable_dp_attention else self.tp_size * self.dp_size

    @property
    def ranks_per_node(self) -> int:
        """Scheduler ranks each node runs (--nnodes > 1 spans one torch world)."""
        return self.num_scheduler_ranks // self.nnodes

    def local_ranks(self) -> range:
        """The global scheduler ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def resolved_load_balance_method(self) -> str:
        """The DP group choice: the flag, else follow_bootstrap_room on a PD prefill node, else round_robin."""
        if self.load_balance_method is not None:
            return self.load_balance_method
        return "follow_bootstrap_room" if self.disaggregation_mode == "prefill" else "round_robin"

    def resolved_attention_backend(self) -> str:
        """The attention backend: the flag, else triton on CUDA and torch_native on CPU."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch_native"

    def resolved_enable_mixed_chunk(self) -> bool:
        """Mixed prefill+decode batches: the flag, else on for CPU (a prompt's prefill spans many decode steps there)."""
        if self.enable_mixed_chunk is not None:
            return self.enable_mixed_chunk
        return self.resolved_device() == "cpu"

    def resolved_mixed_chunk_prefill_size(self) -> Optional[int]:
        """Prefill tokens per mixed batch: the flag, else a small CPU budget, else the chunk size (None: unbounded)."""
        if self.mixed_chunk_prefill_size is not None:
            return self.mixed_chunk_prefill_size
        if self.resolved_device() == "cpu":
            return CPU_MIXED_CHUNK_PREFILL_SIZE
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    def to_dict(self) -> dict[str, Any]:
        """All fields, with the API key masked (for /get_server_info and logs)."""
        d = dataclasses.asdict(self)
        if d.get("api_key"):
            d["api_key"] = "***"
        return d

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per dataclass field, named as SGLang names it."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kwargs: dict[str, Any] = {"dest": f.name, "default": default}
            ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if ftype == "bool":
                kwargs["action"] = "store_true"
            elif ftype == "Optional[bool]":  # tri-state: absent = None (auto), bare flag = True, or an explicit value
                kwargs.update(nargs="?", const=True, type=_parse_bool)
            else:
                kwargs["type"] = _parse_type(ftype)
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
            if default is not None and ftype != "bool":
                help_text += f" (default: {default})"
            parser.add_argument(flag, help=help_text, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """Build from a parsed namespace (unvalidated)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_cli(cls, argv: Optional[Sequence[str]] = None, prog: str = "sglite serve") -> "ServerArgs":
        """Parse and validate; a bad flag exits 2 with one line naming it."""
        parser = _OneLineErrorParser(prog=prog, description="Launch the sglite server.")
        cls.add_cli_args(parser)
        args = parser.parse_args(argv)
        try:
            return cls.from_cli_args(args).validate()
        except ServerArgsError as e:
            parser.error(str(e))
            raise  # unreachable: parser.error exits


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse without the usage dump on errors: one line naming the flag, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def host_port(addr: str) -> Optional[tuple[str, int]]:
    """(host, port) of a ``host:port`` string, else None."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ServerArgsError(message)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_type(type_name: str):
    name = type_name.replace("Optional[", "").rstrip("]")
    return {"int": int, "float": float, "str": str}.get(name, str)
