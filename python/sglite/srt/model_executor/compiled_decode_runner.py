"""A compiled CPU decode step (``--enable-torch-compile``): the model forward through one Inductor graph.

Eager, a SmolLM2 decode layer launches ~30 small kernels besides its 4 GEMMs, each paying ~15-40 us on
caches the GEMMs just flushed, and decode attention copies every layer's K/V rows before SDPA. Compiled,
Inductor fuses the norms, rotary, SiLU*mul and residual adds into a few C++ loops per layer, and the
paged attention of ``layers/attention/compiled_decode.py`` reads K/V through the slot table
(docs/benchmarks.md, "Compiled CPU decode"). vLLM's CPU build compiles its forward the same way.

What runs compiled: DECODE forwards of the target (not a draft) with ``1 <= batch <=
--torch-compile-max-bs`` requests (one graph for all: see ``run``), and blocks of W >= 2 new tokens a request,
causal among them, through a second graph of the same function (W a symbol): a DFLASH-family target's
TARGET_VERIFY blocks, and prefill (EXTEND) batches whose requests all bring the same number of new tokens, as
equal-length prompts do, while their attention scores stay within ``MAX_BLOCK_SCORES``. The model body only
(embedding, layers, final norm; the LM head and logits stay eager). Other forwards (prompts of different lengths,
mixed prefill + decode, the draft's block, larger batches) run eagerly, as SGLang does above its captured batch
sizes. A 32-token prompt at batch 1 runs 1.06x (the 200 M model) to 1.17x (SmolLM2) as fast compiled, 1.02x at
batch 8 and 32 (docs/benchmarks.md, "CPU pinning and compiled prefill blocks, session 18"): the norms, rotary and
SiLU*mul fuse as in decode; its GEMMs are the same. The graphs are compiled at start-up (``warm_up``), so no request
waits on a compile. Inductor caches its code on disk, so a later start with the same model recompiles faster. The
numbers are not bit-identical to eager (fused fp32 arithmetic in another order): tests bound the logits difference
and check greedy output on models with clear margins.

Supported: CPU, TP 1 without DP attention, Llama-family models (Llama, Qwen2, Qwen3), a KV pool stored
in the model dtype. Anything else is a start-up error naming the flag.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import torch

from sglite.srt.layers.attention.compiled_decode import CompiledDecodeAttention, DecodeSlots, TracedDecodeBatch
from sglite.srt.layers.logits_processor import LogitsProcessorOutput
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglite.srt.models.llama import LlamaForCausalLM
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

if TYPE_CHECKING:
    from sglite.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FLAG = "--enable-torch-compile"
# The warm-up batch: 2 requests of 3 keys each. The key-length dim is a backed symbol, which Dynamo would
# specialise at 1 and merge with any equal backed dim (duck sizing); either would recompile on real traffic.
WARM_UP_BS, WARM_UP_KEYS = 2, 3
# The block graph's warm-up width: a symbol of its own (2, not the key count), so any block width from 2 up runs.
WARM_UP_BLOCK_WIDTH = 2
# The block graph's attention materialises its fp32 scores, [batch, W, keys, query heads]: a prefill batch past
# this many (64 MB; SmolLM2's 9 heads reach it at one 1365-token prompt) runs eagerly, where SDPA tiles them.
MAX_BLOCK_SCORES = 1 << 24


class CompiledDecodeError(ValueError):
    """``--enable-torch-compile`` cannot run this configuration."""


def cpp_compiler() -> Optional[str]:
    """The C++ compiler Inductor's CPU backend will call (``$CXX``, else ``g++``), or None when there is none."""
    from torch._inductor.cpp_builder import get_cpp_compiler  # Inductor's own search, so both agree

    try:
        return get_cpp_compiler()
    except Exception:  # Inductor raises its InvalidCxxCompiler (or a subprocess error) when none runs
        return None


def check_compiled_decode_supported(model_runner: "ModelRunner") -> None:
    """Raise CompiledDecodeError naming the flag when the runner's configuration cannot be compiled.

    ServerArgs.validate already refuses the flag-level cases (device, TP, KV dtype) at the command line;
    this re-checks them on the live runner and adds what only a loaded model shows (its class).
    """
    problems = []
    if model_runner.device.type != "cpu":
        problems.append(f"device {model_runner.device.type} (CPU only; CUDA decode uses CUDA graphs)")
    parallel = model_runner.parallel
    if int(getattr(parallel, "tp_size", 1)) != 1 or int(getattr(parallel, "attn_dp_size", 1)) != 1:
        problems.append("tensor or DP-attention parallelism (TP 1 only)")
    if not isinstance(model_runner.model, LlamaForCausalLM):
        problems.append(f"model {type(model_runner.model).__name__} (Llama, Qwen2 and Qwen3 only)")
    pool = model_runner.token_to_kv_pool
    if getattr(pool, "store_dtype", None) != model_runner.dtype or not hasattr(pool, "k_buffer"):
        problems.append(f"KV cache dtype {model_runner.kv_cache_dtype} (the model dtype {model_runner.dtype} only)")
    if problems:
        raise CompiledDecodeError(f"{FLAG} does not support " + "; ".join(problems))
    if cpp_compiler() is None:
        raise CompiledDecodeError(f"{FLAG} needs a C++ compiler for Inductor's CPU code: install g++ or set CXX")


def decode_slots(forward_batch: ForwardBatch) -> DecodeSlots:
    """The slot table of a decode batch or verify block: each request's row of req_to_token, cut at the longest
    sequence, and the block width (the same for every request: build_forward_batch checks it)."""
    max_len = max(forward_batch.seq_lens_cpu)
    table = forward_batch.req_to_token_pool.req_to_token
    rows = forward_batch.req_pool_indices.to(table.device).long()
    width = forward_batch.input_ids.shape[0] // forward_batch.batch_size
    # Contiguous copies, never the batch's own tensors (see CompiledDecodeRunner.run): Dynamo guards on strides,
    # and a DFLASH draft-free step's out_cache_loc is a strided column of its block slots.
    return DecodeSlots(
        kv_indices=table[rows, :max_len].long(),
        seq_lens=_contiguous_copy(forward_batch.seq_lens),
        out_cache_loc=_contiguous_copy(forward_batch.out_cache_loc),
        query_offsets=torch.arange(width, dtype=torch.int64, device=table.device),
    )


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous int64 copy: ``clone()`` and ``to(copy=True)`` keep a strided view's strides."""
    return t.to(torch.int64, copy=True, memory_format=torch.contiguous_format)


class CompiledDecodeRunner:
    """Runs a ModelRunner's eligible decode, prefill-block and verify forwards through ``torch.compile`` of its model
    body."""

    def __init__(self, model_runner: "ModelRunner") -> None:
        check_compiled_decode_supported(model_runner)
        self.model_runner = model_runner
        self.model: LlamaForCausalLM = model_runner.model
        self.max_bs = model_runner.server_args.torch_compile_max_bs
        self.attention = CompiledDecodeAttention(model_runner.token_to_kv_pool)
        self.capture = self._decode_capture_layers()
        # Blocks of W > 1 tokens a request run through a second graph of the same function: equal-length prefills,
        # and a DFLASH-family target's verify blocks (its prefill, draft-free and verify forwards capture the same
        # layers).
        self.verifies = self.capture is not None
        # Only the batch, key-length and block-width dims are symbolic (``run`` marks them); everything else, the
        # capture list's layer ids included, is a constant of the graph (dynamic=True would trace those ints too).
        self._compiled = torch.compile(self._model_body, fullgraph=True)

    def _model_body(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: DecodeSlots
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        # ``[B, W]`` in, flattened here: the token count is then B * W in the graph's shapes, which the
        # attention's per-request view needs (an unbacked token count of its own could not be split).
        batch = TracedDecodeBatch(attn_backend=self.attention, slots=slots, capture_aux_hidden_layers=self.capture)
        return self.model.model(input_ids.reshape(-1), positions.reshape(-1), batch)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether this forward is one the compiled graphs serve: a decode step, an equal-length prefill, or a
        DFLASH-family verify block."""
        if not (
            1 <= forward_batch.batch_size <= self.max_bs
            and forward_batch.input_embeds is None
            and forward_batch.token_to_kv_pool is self.attention.token_to_kv_pool
            and forward_batch.aux_layers() == self.capture
        ):
            return False
        mode = forward_batch.forward_mode
        if mode == ForwardMode.EXTEND:
            return self._is_block_prefill(forward_batch)
        return mode == ForwardMode.DECODE or (mode == ForwardMode.TARGET_VERIFY and self.verifies)

    def _is_block_prefill(self, forward_batch: ForwardBatch) -> bool:
        """An EXTEND whose requests all bring the same W >= 2 new tokens, with scores the block graph may hold."""
        new_tokens = forward_batch.extend_seq_lens_cpu
        width = new_tokens[0]
        if width < 2 or any(n != width for n in new_tokens):
            return False
        heads = self.model.config.num_attention_heads
        return forward_batch.batch_size * width * max(forward_batch.seq_lens_cpu) * heads <= MAX_BLOCK_SCORES

    @torch.inference_mode()  # as the workers run; Dynamo guards on the mode, so every call matches the graph
    def run(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """The forward's logits, the model body compiled and the LM head eager."""
        # Fresh copies made here, under inference mode: Dynamo guards on whether each input is an inference
        # tensor, which depends on where the caller built its batch (a worker, a test, the warm-up).
        slots = decode_slots(forward_batch)
        width = slots.query_offsets.shape[0]
        input_ids = _contiguous_copy(forward_batch.input_ids).reshape(-1, width)
        positions = _contiguous_copy(forward_batch.positions).reshape(-1, width)
        # The batch dim is unbacked: a backed one is specialised at 1 (Dynamo's 0/1 rule, through
        # broadcasting checks), which would cost batch 1 a second whole-model compile (~80 s on 2 cores);
        # unbacked, one graph serves batch 1 too, its GEMVs on the plain weight (cpu_gemm's row rule).
        for t in (input_ids, positions, slots.seq_lens, slots.out_cache_loc, slots.kv_indices):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        torch._dynamo.mark_dynamic(slots.kv_indices, 1)
        if width > 1:  # a block: its width is a symbol too (a decode step's 1 is a constant of its graph)
            for t in (input_ids, positions, slots.query_offsets):
                torch._dynamo.mark_dynamic(t, t.dim() - 1)
        hidden, aux = self._compiled(input_ids, positions, slots)
        return self.model.logits_processor(hidden, self.model.lm_head, forward_batch, aux)

    def _decode_capture_layers(self) -> Optional[list[int]]:
        """The aux layers a decode forward of this target captures: a DFLASH-family target's draft-free steps."""
        runner = self.model_runner
        if SpeculativeAlgorithm.from_string(runner.server_args.speculative_algorithm).is_dflash_family():
            return [int(i) for i in runner.spec_aux_config.target_layer_ids]
        return None

    def warm_up(self) -> None:
        """Compile the graphs on dummy batches: req row 0 and KV slot 0, the reserved padding."""
        runner = self.model_runner
        # One batch per graph: the block graph through a verify block where the target verifies, else a prefill.
        block_mode = ForwardMode.TARGET_VERIFY if self.verifies else ForwardMode.EXTEND
        modes = [(ForwardMode.DECODE, 1), (block_mode, WARM_UP_BLOCK_WIDTH)]
        logger.info(
            "Compile decode forward (torch.compile) begin: batch sizes 1 to %d, %s",
            self.max_bs, " and ".join(m.name for m, _ in modes),
        )
        start = time.perf_counter()
        for mode, width in modes:
            batch = runner.build_forward_batch(
                mode,
                [(0, WARM_UP_KEYS - width, [0] * width)] * WARM_UP_BS,
                out_cache_loc=torch.zeros(WARM_UP_BS * width, dtype=torch.int64, device=runner.device),
                capture_aux_hidden_layers=self.capture,
            )
            self.run(batch)
        logger.info("Compile decode forward (torch.compile) end. elapsed=%.1f s", time.perf_counter() - start)


def build_compiled_decode_runner(model_runner: "ModelRunner") -> Optional[CompiledDecodeRunner]:
    """The runner's compiled decode step under ``--enable-torch-compile`` (targets only), else None."""
    if not model_runner.server_args.enable_torch_compile or model_runner.is_draft:
        return None
    return CompiledDecodeRunner(model_runner)
