"""A compiled CPU decode step (``--enable-torch-compile``): the model forward through one Inductor graph.

Eager, a SmolLM2 decode layer launches ~30 small kernels besides its 4 GEMMs, each paying ~15-40 us on
caches the GEMMs just flushed, and decode attention copies every layer's K/V rows before SDPA. Compiled,
Inductor fuses the norms, rotary, SiLU*mul and residual adds into a few C++ loops per layer, and the
paged attention of ``layers/attention/compiled_decode.py`` reads K/V through the slot table
(docs/benchmarks.md, "Compiled CPU decode"). vLLM's CPU build compiles its forward the same way.

What runs compiled: forwards of the target (not a draft) with ``1 <= batch <= --torch-compile-max-bs`` requests,
through two graphs of the same function. DECODE steps run through the decode graph (one graph for every batch
size: see ``run``). Other forwards of new tokens run through the token graph, whose attention gives each new token
its request's slot-table row and its own key index: prefills, mixed prefill + decode steps and a DFLASH-family
target's TARGET_VERIFY blocks. Its attention is the C++ kernel ``sglite::paged_attention`` where that serves the
model (``attention_kernel_serves``); otherwise the torch formulation, which reads every key once per prompt token, so
then a prefill or mixed step runs compiled only where the cost model ``compiled_extend_pays`` says the graph is faster
(short prompts; decode rows outweighing long ones), and only while its fp32 scores stay within ``MAX_ATTENTION_SCORES``.
A bf16 model's forwards reach the kernel through an fp32 copy of their K/V rows, within ``MAX_WIDENED_KV_ELEMENTS``.
The model body only (embedding, layers, final norm; the LM head and logits stay eager). Other forwards (the
draft's block, larger batches) run eagerly, as SGLang does above its captured batch sizes. A 32-token prompt at
batch 1 runs 1.05x-1.17x as fast compiled, 1.02x-1.04x at batch 8 and 32; a mixed step (one 32-token prompt beside 7
or 31 decode rows) 1.04x-1.09x, and with a 256-token prompt 1.10x-1.33x (docs/benchmarks.md, "CPU pinning" and
"A paged attention kernel for prefills, mixed steps and verify blocks"): the norms, rotary and SiLU*mul fuse as in decode; the GEMMs, which dominate these forwards, are the
same. The graphs are compiled at start-up (``warm_up``), so no request waits on a compile, and then called without
Dynamo's guard check (``_direct_call``). Inductor caches its code on disk, so a later start with the same model
recompiles faster. The numbers are not bit-identical to eager (fused fp32 arithmetic in another order): tests bound
the logits difference and check greedy output on models with clear margins.

Supported: CPU, TP 1 without DP attention, Llama-family models (Llama, Qwen2, Qwen3), a KV pool stored
in the model dtype. Anything else is a start-up error naming the flag.
"""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglite.srt.layers.attention.compiled_decode import (
    KERNEL_KV_DTYPES,
    CompiledDecodeAttention,
    DecodeSlots,
    TracedDecodeBatch,
)
from sglite.srt.layers.attention.cpu_paged_attention import kernel_serves
from sglite.srt.layers.attention.radix_attention import RadixAttention
from sglite.srt.layers.logits_processor import LogitsProcessorOutput
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglite.srt.models.llama import LlamaForCausalLM
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

if TYPE_CHECKING:
    from sglite.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FLAG = "--enable-torch-compile"
# The warm-up batches: 2 requests of 3 keys each. The key-length dim is a backed symbol, which Dynamo would
# specialise at 1 and merge with any equal backed dim (duck sizing); either would recompile on real traffic.
WARM_UP_KEYS = 3
# The token graph's warm-up: new tokens per request, unequal so that nothing in the graph assumes equal counts.
WARM_UP_NEW_TOKENS = [2, 1]
# Without the C++ kernel, the token graph's attention materialises its fp32 scores, [new tokens, keys, query heads]: a
# forward past this many (64 MB; e.g. a verify block on a long context) runs eagerly, where SDPA tiles them.
MAX_ATTENTION_SCORES = 1 << 24
# With the kernel on a bf16 pool, the forward's K/V rows are widened into one fp32 copy, [requests, longest sequence, KV
# heads, head dim + V head dim]: a forward past this many elements (64 MB, as the scores budget; long contexts at a
# large batch) runs eagerly.
MAX_WIDENED_KV_ELEMENTS = 1 << 24
# Without the C++ kernel, the token graph's attention reads every key of the longest sequence for each new token, with
# none of eager SDPA's reuse across one prompt's queries; it pays where the graph's fused element-wise ops save more.
# Measured on SmolLM2 (docs/benchmarks.md, "A paged attention kernel for prefills, mixed steps and verify blocks"): a prompt token breaks even at ~48
# keys (a 1,024-token prompt took twice as long compiled), while each decode row of a mixed step saves what ~448
# prompt-token key reads cost (eager, a mixed step's decode rows go through the prefill attention one request at a
# time). A model with a wider hidden size has relatively cheaper attention, so these are on the safe side for it.
PROMPT_TOKEN_BREAK_EVEN_KEYS = 48
DECODE_ROW_KEY_CREDIT = 448


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


def compiled_extend_pays(new_tokens: list[int], max_keys: int) -> bool:
    """Whether a prefill or mixed step runs faster through the token graph than eagerly, by the measured cost model:
    prompt tokens (of requests bringing more than one) past the break-even key count, against its decode rows."""
    prompt_tokens = sum(n for n in new_tokens if n > 1)
    decode_rows = sum(1 for n in new_tokens if n == 1)
    return prompt_tokens * (max_keys - PROMPT_TOKEN_BREAK_EVEN_KEYS) <= DECODE_ROW_KEY_CREDIT * decode_rows


def attention_kernel_serves(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the C++ paged attention kernel serves every attention layer of ``model`` (its dtype, head geometry): it
    computes in fp32, and a bf16 model's K/V rows are widened to fp32 first (``CompiledDecodeAttention``)."""
    if dtype not in KERNEL_KV_DTYPES:
        return False
    layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
    served = (kernel_serves(torch.float32, a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim) for a in layers)
    return bool(layers) and all(served)


def new_tokens_per_request(forward_batch: ForwardBatch) -> list[int]:
    """How many new tokens each request of a forward brings: its prompt chunk (1 for a decode row of a mixed
    step), its verify block, or one in a decode step."""
    if forward_batch.forward_mode == ForwardMode.EXTEND:
        return list(forward_batch.extend_seq_lens_cpu)
    return [forward_batch.input_ids.shape[0] // forward_batch.batch_size] * forward_batch.batch_size


def decode_slots(forward_batch: ForwardBatch) -> DecodeSlots:
    """The slot table of a forward: each request's row of req_to_token, cut at the longest sequence, and, past a
    decode step, each new token's request row and key index."""
    max_len = max(forward_batch.seq_lens_cpu)
    table = forward_batch.req_to_token_pool.req_to_token
    rows = forward_batch.req_pool_indices.to(table.device).long()
    # Contiguous copies, never the batch's own tensors (see CompiledDecodeRunner.run): Dynamo guards on strides,
    # and a DFLASH draft-free step's out_cache_loc is a strided column of its block slots.
    slots = DecodeSlots(
        kv_indices=table[rows, :max_len].long(),
        seq_lens=_contiguous_copy(forward_batch.seq_lens),
        out_cache_loc=_contiguous_copy(forward_batch.out_cache_loc),
    )
    if forward_batch.forward_mode != ForwardMode.DECODE:
        new_tokens = torch.tensor(new_tokens_per_request(forward_batch), dtype=torch.int64)
        token_rows = torch.repeat_interleave(torch.arange(len(new_tokens)), new_tokens)
        first_token = torch.cumsum(new_tokens, 0) - new_tokens
        # Token j of request b sits at key index seq_len - new_tokens + j: its new tokens are its last keys.
        within = torch.arange(len(token_rows)) - first_token[token_rows]
        key_index = slots.seq_lens.cpu()[token_rows] - new_tokens[token_rows] + within
        slots.token_rows = token_rows.to(table.device)
        slots.token_key_index = key_index.to(table.device)
    return slots


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous int64 copy: ``clone()`` and ``to(copy=True)`` keep a strided view's strides."""
    return t.to(torch.int64, copy=True, memory_format=torch.contiguous_format)


class CompiledDecodeRunner:
    """Runs a ModelRunner's eligible decode, prefill, mixed and verify forwards through ``torch.compile`` of its model
    body."""

    def __init__(self, model_runner: "ModelRunner") -> None:
        check_compiled_decode_supported(model_runner)
        self.model_runner = model_runner
        self.model: LlamaForCausalLM = model_runner.model
        self.max_bs = model_runner.server_args.torch_compile_max_bs
        self.attention = CompiledDecodeAttention(
            model_runner.token_to_kv_pool, attention_kernel_serves(self.model, model_runner.dtype)
        )
        logger.info(
            "Compiled forwards of several new tokens a request attend through %s",
            "the C++ paged attention kernel" if self.attention.use_kernel else "the torch formulation (no C++ kernel "
            "for this dtype or head size, or SGLITE_CPU_PAGED_ATTENTION_KERNEL=0): long prompts run eagerly",
        )
        # The pool's geometry is fixed, so ``can_run`` does not look the widened copy's size up per forward.
        self._widened_elements_per_key = CompiledDecodeAttention.widened_elements_per_key(
            *model_runner.token_to_kv_pool.get_kv_buffer(0)
        )
        self.capture = self._decode_capture_layers()
        # Forwards of several new tokens a request run through a second graph of the same function, the token graph:
        # prefills, mixed steps and a DFLASH-family target's verify blocks (its prefill, draft-free and verify
        # forwards capture the same layers).
        self.verifies = self.capture is not None
        # Only the batch, token and key-length dims are symbolic (``_guarded`` marks them); everything else, the
        # capture list's layer ids included, is a constant of the graph (dynamic=True would trace those ints too).
        self._compiled = torch.compile(self._model_body, fullgraph=True)
        # The warm-up's graphs called directly, keyed by ``_serves_tokens`` (the token graph, or the decode graph);
        # see ``_direct_call``. Empty until the warm-up, and where this torch exposes no cache entries.
        self._direct: dict[bool, Callable] = {}

    def _model_body(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: DecodeSlots
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        batch = TracedDecodeBatch(attn_backend=self.attention, slots=slots, capture_aux_hidden_layers=self.capture)
        return self.model.model(input_ids, positions, batch)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether this forward is one the compiled graphs serve: a decode step, a prefill or mixed prefill + decode
        step, or a DFLASH-family verify block; without the C++ attention kernel, only those the cost model says pay
        and within the scores budget."""
        if not (
            1 <= forward_batch.batch_size <= self.max_bs
            and forward_batch.input_embeds is None
            and forward_batch.token_to_kv_pool is self.attention.token_to_kv_pool
            and forward_batch.aux_layers() == self.capture
        ):
            return False
        mode = forward_batch.forward_mode
        if mode == ForwardMode.DECODE:
            return True
        if not (mode == ForwardMode.EXTEND or (mode == ForwardMode.TARGET_VERIFY and self.verifies)):
            return False
        if self.attention.use_kernel:
            # It materialises no scores, and compiled was at least level with eager at every prompt length measured
            # (1-1,024 tokens); a bf16 pool's rows are widened first, within budget.
            return self._widened_kv_fits(forward_batch)
        if mode == ForwardMode.EXTEND and not compiled_extend_pays(
            forward_batch.extend_seq_lens_cpu, max(forward_batch.seq_lens_cpu)
        ):
            return False
        return self._scores_fit(forward_batch)

    def _widened_kv_fits(self, forward_batch: ForwardBatch) -> bool:
        """Whether the fp32 copy of the forward's K/V rows the kernel reads (none for an fp32 pool) stays within budget."""
        keys = forward_batch.batch_size * max(forward_batch.seq_lens_cpu)
        return keys * self._widened_elements_per_key <= MAX_WIDENED_KV_ELEMENTS

    def _scores_fit(self, forward_batch: ForwardBatch) -> bool:
        """Whether the torch formulation's fp32 scores, [new tokens, longest sequence, query heads], stay within
        budget."""
        heads = self.model.config.num_attention_heads
        return forward_batch.input_ids.shape[0] * max(forward_batch.seq_lens_cpu) * heads <= MAX_ATTENTION_SCORES

    @property
    def calls_graphs_directly(self) -> bool:
        """Whether forwards skip Dynamo's cache lookup (both graphs' code kept at the warm-up; ``_direct_call``)."""
        return bool(self._direct)

    @torch.inference_mode()  # as the workers run; Dynamo guards on the mode, so every call matches the graph
    def run(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """The forward's logits, the model body compiled and the LM head eager."""
        input_ids, positions, slots = self._graph_inputs(forward_batch)
        direct = self._direct.get(_serves_tokens(slots))
        if direct is not None:
            hidden, aux = direct(self, input_ids, positions, slots)
        else:
            hidden, aux = self._guarded(input_ids, positions, slots)
        return self.model.logits_processor(hidden, self.model.lm_head, forward_batch, aux)

    def _graph_inputs(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, DecodeSlots]:
        """The graph's arguments: fresh contiguous int64 copies, made here under inference mode.

        Dynamo guards on whether each input is an inference tensor, which depends on where the caller built its batch
        (a worker, a test, the warm-up), and on strides and dtypes; copies made here are alike whoever built it.
        """
        return _contiguous_copy(forward_batch.input_ids), _contiguous_copy(forward_batch.positions), decode_slots(
            forward_batch
        )

    def _guarded(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: DecodeSlots
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The model body through Dynamo: its guards pick (or compile) the graph."""
        # The batch and token dims are unbacked: a backed one is specialised at 1 (Dynamo's 0/1 rule, through
        # broadcasting checks), which would cost batch 1 a second whole-model compile (~80 s on 2 cores);
        # unbacked, one graph serves batch 1 too, its GEMVs on the plain weight (cpu_gemm's row rule).
        per_token = [input_ids, positions, slots.out_cache_loc]
        if slots.token_rows is not None:
            per_token += [slots.token_rows, slots.token_key_index]
        for t in per_token + [slots.seq_lens, slots.kv_indices]:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        torch._dynamo.mark_dynamic(slots.kv_indices, 1)
        return self._compiled(input_ids, positions, slots)

    def _direct_call(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: DecodeSlots
    ) -> Optional[Callable]:
        """The code Dynamo generated for the graph that serves these arguments, as a function to call without its
        cache lookup; None where this torch exposes no cache entries.

        The lookup evaluates ~5,600 guards a call, nearly all on this runner's own attributes (weights, KV buffers,
        config), which never change, and cost ~1.6 ms a forward: 9% of a SmolLM2 decode step at batch 1
        (docs/benchmarks.md, "Compiled graphs called without the guard check"). What differs between
        calls is fixed by ``_graph_inputs`` (int64, contiguous, inference mode) except which graph serves them, so
        ``run`` keys the two graphs by ``_serves_tokens``. vLLM's compiled forward dispatches to
        its compiled code the same way. Dynamo's cache is kept per code object, shared by every runner in a process,
        so the entry is the one whose guards accept this runner's call, as Dynamo's lookup would choose.
        """
        entries_of = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
        if entries_of is None:
            return None
        body = CompiledDecodeRunner._model_body
        f_locals = {"self": self, "input_ids": input_ids, "positions": positions, "slots": slots}
        try:  # a debug hook: another torch may shape its entries differently, which only costs the speed-up
            for entry in entries_of(body.__code__):
                if entry.guard_manager.check(f_locals):
                    return types.FunctionType(entry.code, body.__globals__, body.__name__)
        except (AttributeError, TypeError) as e:
            logger.warning("Dynamo's cache entries are not readable here (%s)", e)
        return None

    def _decode_capture_layers(self) -> Optional[list[int]]:
        """The aux layers a decode forward of this target captures: a DFLASH-family target's draft-free steps."""
        runner = self.model_runner
        if SpeculativeAlgorithm.from_string(runner.server_args.speculative_algorithm).is_dflash_family():
            return [int(i) for i in runner.spec_aux_config.target_layer_ids]
        return None

    def warm_up(self) -> None:
        """Compile the graphs on dummy batches (req row 0 and KV slot 0, the reserved padding), then keep each one's
        code to call directly (``_direct_call``), checked to give the guarded call's output."""
        runner = self.model_runner
        # One batch per graph: a decode step, and a prefill whose two requests bring 2 and 1 new tokens (the token
        # graph then serves any mix of new-token counts: prefills, mixed steps, verify blocks).
        warm_ups = [(ForwardMode.DECODE, [1, 1]), (ForwardMode.EXTEND, WARM_UP_NEW_TOKENS)]
        logger.info("Compile decode forward (torch.compile) begin: batch sizes 1 to %d, DECODE and EXTEND", self.max_bs)
        start = time.perf_counter()
        direct: dict[bool, Callable] = {}
        for mode, new_tokens in warm_ups:
            batch = runner.build_forward_batch(
                mode,
                [(0, WARM_UP_KEYS - n, [0] * n) for n in new_tokens],
                out_cache_loc=torch.zeros(sum(new_tokens), dtype=torch.int64, device=runner.device),
                capture_aux_hidden_layers=self.capture,
            )
            with torch.inference_mode():
                args = self._graph_inputs(batch)
                guarded = self._guarded(*args)
                call = self._direct_call(*args)
                if call is not None and _same_outputs(call(self, *args), guarded):
                    direct[_serves_tokens(args[2])] = call
        logger.info("Compile decode forward (torch.compile) end. elapsed=%.1f s", time.perf_counter() - start)
        if len(direct) == len(warm_ups):
            self._direct = direct
        else:
            logger.warning(
                "Compiled forwards go through Dynamo's guard check (~1.6 ms a forward): this torch build's cache "
                "entries could not be called directly"
            )


def _serves_tokens(slots: DecodeSlots) -> bool:
    """Which graph a forward's slots call for: the token graph (token rows given) or the decode graph."""
    return slots.token_rows is not None


def _same_outputs(
    a: tuple[torch.Tensor, Optional[torch.Tensor]], b: tuple[torch.Tensor, Optional[torch.Tensor]]
) -> bool:
    """Whether two calls of the model body gave bit-identical hidden states and captures (the same graph ran)."""
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (a[1] is None or torch.equal(a[1], b[1]))


def build_compiled_decode_runner(model_runner: "ModelRunner") -> Optional[CompiledDecodeRunner]:
    """The runner's compiled decode step under ``--enable-torch-compile`` (targets only), else None."""
    if not model_runner.server_args.enable_torch_compile or model_runner.is_draft:
        return None
    return CompiledDecodeRunner(model_runner)
