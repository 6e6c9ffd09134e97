"""CPU GEMM for small batches on packed weights (linear layers and LM heads of target and draft), fp32 or bf16.

At decode batch sizes (M = 2..64 rows) a BLAS ``sgemm`` spends much of each call re-blocking the weight
into its micro-kernel layout; packing the weight once removes that. Two packs exist in torch's x86 CPU
builds: MKL's (``mkl::_mkl_reorder_linear_weight`` / ``mkl::_mkl_linear``) and oneDNN's
(``mkldnn::_reorder_linear_weight`` / ``mkldnn::_linear_pointwise``, the one vLLM's CPU build uses).
Which is faster depends on the host (docs/benchmarks.md, "A small-M CPU kernel, chosen per row count, and the GEMM
packs"), so
``pack_weights_for_cpu`` times both on the model's own weights and keeps the faster (``choose_pack_layout``). A pack
is slower at M = 1 (a bandwidth-bound gemv), so it serves from ``PACKED_MIN_ROWS``; its upper limit is timed too
(``choose_packed_max_rows``; ``PACKED_MAX_ROWS`` where untimed), and ``F.linear`` on the column-major weight
(layers/utils.new_weight_matrix) serves the rest. The price is a second copy of the weights in memory (vLLM's CPU
build drops the original and pays at M = 1 instead). Both packs are M-independent, so one serves every batch.

bf16 weights get oneDNN's pack only (MKL's is an sgemm pack), from one row (``packed_min_rows``): where the CPU has
bf16 dot products (AVX512_BF16, AMX) its products run ~2x the fp32 rate, and unpacked ``F.linear`` re-blocks the
weight on every call (docs/benchmarks.md, "bf16 on CPU"). The small-M and GGUF kernels compute in fp32
and serve fp32 weights only (``fp32_kernels_serve``).

At 1-16 rows sglite's small-M kernel (layers/cpu_small_m.py) may beat the pack (1 row: ``F.linear``), or not, by
host and row count (docs/benchmarks.md, "A small-M CPU kernel, chosen per row count"): the probe times it against that
route at ``SMALL_M_PROBE_ROWS`` per weight orientation (``PackedWeight.small_m_rows``).

A weight loaded from a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks also carries those blocks (``PackedWeight.gguf``):
at 1-16 rows the GGUF kernel (layers/cpu_gguf_linear.py) reads them instead of the fp32 copy, at the row counts
where the probe finds it faster than the route above (``PackedWeight.gguf_rows``, ``choose_gguf_rows``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglite.srt.layers.cpu_gguf_linear import (
    GGUF_MAX_ROWS,
    GGUFWeight,
    gguf_kernel_available,
    gguf_linear,
    start_building_gguf_kernel,
)
from sglite.srt.layers.cpu_small_m import (
    SMALL_M_MAX_ROWS,
    SMALL_M_MIN_ROWS,
    small_m_kernel,
    small_m_linear,
    start_building_small_m_kernel,
)

logger = logging.getLogger(__name__)

# The M a pack is tuned for: a decode batch. Any M is computed correctly with it.
_PACK_BATCH_HINT = 32
# Rows (tokens) for which a packed copy beats sgemm on the column-major weight (measured above). Past
# PACKED_MAX_ROWS (a prefill chunk, a mixed step, a verify of many requests) it depends on the host, so the probe
# times it at PREFILL_PROBE_ROWS and may raise a weight's limit (PackedWeight.max_rows).
PACKED_MIN_ROWS = 2
# bf16: oneDNN's pack beats F.linear at one row too (a SmolLM2 step's weights: 21.4 against 36.3 ms; docs/benchmarks.md,
# "bf16 on CPU").
BF16_PACKED_MIN_ROWS = 1
PACKED_MAX_ROWS = 64
PREFILL_PROBE_ROWS = (256, 1024)
PREFILL_PROBE_BYTES = 8 << 20  # compute-bound at these counts: a small slice times it, and keeps start-up short
PREFILL_PROBE_REPEATS = 2
UNBOUNDED_ROWS = 1 << 62  # PackedWeight.max_rows when the pack won at every prefill probe

PACK_LAYOUTS = ("onednn", "mkl")
# Below this many bytes of packable weights the probe would time cache hits, not the weight stream a
# decode step pays: such a (test-sized) model takes DEFAULT_PACK_LAYOUT without timing, deterministically.
PROBE_MIN_BYTES = 64 << 20
PROBE_ROWS = (4, 32)  # a verify block and a decode batch
PROBE_REPEATS = 3  # best of, per layout
DEFAULT_PACK_LAYOUT = "onednn"
# Row counts at which the small-M kernel is timed against the pack; an untimed count r takes the verdict of the
# first probed count >= r (a DFLASH verify block is 5 rows a request, a decode step 1 a request).
SMALL_M_PROBE_ROWS = (1, 2, 4, 8, 12, 16)
# Bit r set: the kernel serves r-row products. Untimed (test models): 2-16 rows, a gemv stays with F.linear.
ALL_SMALL_M_ROWS = sum(1 << r for r in range(PACKED_MIN_ROWS, SMALL_M_MAX_ROWS + 1))
ORIENTATIONS = ("column-major", "row-major")  # layers (utils.new_weight_matrix) / a tied head's embedding
# Row counts at which the GGUF kernel is timed against the fp32 route (F.linear, the small-M kernel or the pack, as
# chosen for that count), over the first GGUF_PROBE_MIN_BYTES of blocks (past a 32 MB L3), best of
# GGUF_PROBE_REPEATS. The kernel is compute-bound where the fp32 route streams memory, so neither is a cache hit.
GGUF_PROBE_ROWS = (1, 2, 4, 8, 12, 16)
GGUF_PROBE_MIN_BYTES = 36 << 20
GGUF_PROBE_REPEATS = 2
# Bit r set: the GGUF kernel serves r-row products. Every count it covers, for blocks too few to time (test models).
ALL_GGUF_ROWS = sum(1 << r for r in range(1, GGUF_MAX_ROWS + 1))


@dataclass(frozen=True)
class PackedWeight:
    """A weight's packed copy, the most rows it serves, and the row counts that take the small-M kernel instead
    (bit r for r rows); for a weight loaded from GGUF blocks the kernel reads, those blocks and the row counts
    they serve (before the rest)."""

    tensor: torch.Tensor
    small_m_rows: int = ALL_SMALL_M_ROWS
    max_rows: int = PACKED_MAX_ROWS
    gguf: Optional[GGUFWeight] = None
    gguf_rows: int = 0


def orientation(weight: torch.Tensor) -> str:
    """The small-M kernel's name for a weight's memory layout: "row-major" when contiguous, else "column-major"."""
    return "row-major" if weight.is_contiguous() else "column-major"


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed sgemm (x86 CPU builds do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available_pack_layouts(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The pack layouts this torch build offers for ``dtype`` weights, in PACK_LAYOUTS order (bf16: oneDNN's only)."""
    if dtype == torch.bfloat16:
        return ("onednn",) if onednn_packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
    if dtype != torch.float32:
        return ()
    have = {"onednn": onednn_packing_available(), "mkl": mkl_packing_available()}
    return tuple(name for name in PACK_LAYOUTS if have[name])


def packed_min_rows(dtype: torch.dtype) -> int:
    """The fewest rows a ``dtype`` pack serves: fp32 leaves a gemv to ``F.linear`` (it streams the plain weight faster),
    bf16 packs serve one row too."""
    return BF16_PACKED_MIN_ROWS if dtype == torch.bfloat16 else PACKED_MIN_ROWS


def pack_weight(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """A packed copy of a ``[out, in]`` fp32 or bf16 CPU weight in ``layout`` ("onednn" or "mkl")."""
    w = weight.detach().contiguous()
    if layout == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    if layout == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(w, _PACK_BATCH_HINT)
    raise ValueError(f"unknown CPU pack layout {layout!r}; expected one of {PACK_LAYOUTS}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[PackedWeight]) -> torch.Tensor:
    """``x W^T + b``: through the packed copy for decode-sized batches when the layer has one, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    blocks, ggml_type = (packed.gguf.blocks, packed.gguf.ggml_type) if packed.gguf is not None else (None, 0)
    if torch.compiler.is_compiling():
        # One opaque op: Inductor cannot lower ``_mkl_linear`` on a packed weight it did not make
        # itself, and the row-count choice stays at run time (no shape guard, one graph for all M).
        return torch.ops.sglite.packed_linear(
            x, packed.tensor, weight, bias, packed.small_m_rows, packed.max_rows, blocks, ggml_type, packed.gguf_rows
        )
    return _linear_with_pack(
        x, packed.tensor, weight, bias, packed.small_m_rows, packed.max_rows, blocks, ggml_type, packed.gguf_rows
    )


def _linear_with_pack(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], small_m_rows: int,
    max_rows: int, gguf_blocks: Optional[torch.Tensor] = None, gguf_type: int = 0, gguf_rows: int = 0,
) -> torch.Tensor:
    """The GGUF blocks at the row counts set in ``gguf_rows``, else the small-M kernel at those set in ``small_m_rows``,
    else the packed copy for ``packed_min_rows <= rows <= max_rows``, else ``F.linear`` on the weight."""
    rows = x.numel() // x.shape[-1]
    if gguf_blocks is not None and rows <= GGUF_MAX_ROWS and gguf_rows >> rows & 1:
        if (quantized := gguf_linear(x, gguf_blocks, gguf_type, bias)) is not None:
            return quantized
    if rows <= SMALL_M_MAX_ROWS and small_m_rows >> rows & 1:
        if (small := small_m_linear(x, weight, bias)) is not None:
            return small
    if not packed_min_rows(weight.dtype) <= rows <= max_rows:
        return F.linear(x, weight, bias)
    return _pack_linear(x, packed, weight, bias)


def _pack_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` through the packed copy (any number of rows)."""
    # oneDNN's pack keeps the weight's [out, in] shape; MKL's is a flat [elements, 1] buffer.
    if packed.shape == weight.shape:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.numel() // x.shape[-1])


# ``sglite::packed_linear``: ``_linear_with_pack`` as a registered op, for compiled forwards
# (model_executor/compiled_decode_runner.py). A plain Library registration: torch.library.custom_op's
# Python wrapper costs ~50 us a call, ~120 calls a step.
_LIB = torch.library.Library("sglite", "DEF")
_LIB.define(
    "packed_linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias, int small_m_rows, int max_rows, "
    "Tensor? gguf_blocks, int gguf_type, int gguf_rows) -> Tensor"
)


def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], small_m_rows: int,
    max_rows: int, gguf_blocks: Optional[torch.Tensor], gguf_type: int, gguf_rows: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_LIB.impl("packed_linear", _linear_with_pack, "CompositeExplicitAutograd")  # a pack is an MkldnnCPU tensor
torch.library.register_fake("sglite::packed_linear", _packed_linear_fake, lib=_LIB)


def packs_weights_of(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` get a CPU pack: fp32 on CPU, and bf16 where oneDNN packs it."""
    return device.type == "cpu" and bool(available_pack_layouts(dtype))


def fp32_kernels_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the small-M and GGUF kernels serve weights on ``device`` in ``dtype`` (they compute in fp32)."""
    return dtype == torch.float32 and packs_weights_of(device, dtype)


def prepare_cpu_gemm(device: torch.device, dtype: torch.dtype, reads_gguf: bool = False) -> None:
    """Before a model's weights load: start building the small-M kernel (and, for a GGUF checkpoint, the GGUF
    kernel) when its linears will use it."""
    if fp32_kernels_serve(device, dtype):
        start_building_small_m_kernel()  # a first start compiles it (~3-5 s) while the weights load
        if reads_gguf:
            start_building_gguf_kernel()


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        getattr(module, "packed_weight", False) is None  # the layer opted in (see _init_packed_slot)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and packs_weights_of(weight.device, weight.dtype)
    )


@dataclass(frozen=True)
class PackChoice:
    """The pack layout a model's weights got, and what the probe measured (empty when it did not time)."""

    layout: str
    # per layout: the probe set's GEMMs at PROBE_ROWS, best of PROBE_REPEATS
    probe_ms: dict[str, float] = field(default_factory=dict)
    probe_bytes: int = 0  # weight bytes the probe streamed per pass
    # per orientation: the row counts the small-M kernel serves (PackedWeight.small_m_rows); untimed: all it covers
    small_m_rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORIENTATIONS, ALL_SMALL_M_ROWS))
    # per orientation timed: {rows: (kernel ms, pack ms)} at SMALL_M_PROBE_ROWS, best of PROBE_REPEATS
    small_m_probe_ms: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    # per orientation: the most rows the pack serves (PackedWeight.max_rows); untimed: PACKED_MAX_ROWS
    packed_max_rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORIENTATIONS, PACKED_MAX_ROWS))
    # per orientation timed: {rows: (pack ms, F.linear ms)} at PREFILL_PROBE_ROWS, best of PREFILL_PROBE_REPEATS
    prefill_probe_ms: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    # the row counts the GGUF kernel serves (PackedWeight.gguf_rows), when the model has GGUF blocks it reads
    gguf_rows: int = 0
    # timed: {rows: (GGUF kernel ms, fp32 route ms)} at GGUF_PROBE_ROWS, best of GGUF_PROBE_REPEATS
    gguf_probe_ms: dict[int, tuple[float, float]] = field(default_factory=dict)


def _probe_prefix(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """The first weights that reach PROBE_MIN_BYTES (past the caches, so a pass times the weight stream), and their bytes."""
    probe, size = [], 0
    for w in weights:
        if size >= PROBE_MIN_BYTES:
            break
        probe.append(w)
        size += w.numel() * w.element_size()
    return probe, size


def choose_pack_layout(weights: list[torch.Tensor], layouts: tuple[str, ...]) -> PackChoice:
    """The faster layout on these weights: the first PROBE_MIN_BYTES of them packed both ways and timed.

    Only a prefix is packed twice, so the probe's extra memory stays about 2 x (PROBE_MIN_BYTES + one
    weight) however large the model. Timed in process CPU time (``time.process_time``), which is steadier
    than wall time on a shared box.
    """
    probe, size = _probe_prefix(weights)
    if len(layouts) == 1 or size < PROBE_MIN_BYTES:
        layout = DEFAULT_PACK_LAYOUT if DEFAULT_PACK_LAYOUT in layouts else layouts[0]
        return PackChoice(layout=layout)
    packs = {name: [pack_weight(w, name) for w in probe] for name in layouts}
    inputs = {rows: {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in probe} for rows in PROBE_ROWS}
    best = {name: float("inf") for name in layouts}
    for _ in range(PROBE_REPEATS):
        for name in layouts:  # interleaved, so a slow moment of the box hits both
            t0 = time.process_time()
            for rows, xs in inputs.items():
                for w, p in zip(probe, packs[name]):
                    _pack_linear(xs[w.shape[1]], p, w, None)
            best[name] = min(best[name], time.process_time() - t0)
    probe_ms = {name: t * 1e3 for name, t in best.items()}
    return PackChoice(layout=min(probe_ms, key=probe_ms.get), probe_ms=probe_ms, probe_bytes=size)


def choose_small_m_rows(
    weights: list[torch.Tensor], packs: list[torch.Tensor]
) -> tuple[int, dict[int, tuple[float, float]]]:
    """The row counts (bitmask) at which the small-M kernel beats the pack (1 row: F.linear) on these weights.

    ``packs``: the weights' packed copies, in order. The first PROBE_MIN_BYTES of them, both ways at each of
    SMALL_M_PROBE_ROWS (``_time_two_ways``), best of PROBE_REPEATS; a count r between probes takes the verdict of
    the first probed count >= r. Too few bytes to time past the caches: ALL_SMALL_M_ROWS. No kernel (switched off,
    no compiler): none. Returns the mask and {rows: (kernel ms, other ms)} (empty when untimed).
    """
    if small_m_kernel() is None or any(not fp32_kernels_serve(w.device, w.dtype) for w in weights):
        return 0, {}
    probe, size = _probe_prefix(weights)
    if size < PROBE_MIN_BYTES:
        return ALL_SMALL_M_ROWS, {}
    timed = _time_two_ways(
        probe, SMALL_M_PROBE_ROWS, PROBE_REPEATS,
        lambda x, i: small_m_linear(x, probe[i], None),  # against what serves those rows without it
        lambda x, i: F.linear(x, probe[i]) if len(x) < PACKED_MIN_ROWS else _pack_linear(x, packs[i], probe[i], None),
    )
    return small_m_rows_where_faster(timed), timed


def _time_two_ways(
    weights: list[torch.Tensor], row_counts: tuple[int, ...], repeats: int,
    first: Callable[[torch.Tensor, int], object], second: Callable[[torch.Tensor, int], object],
) -> dict[int, tuple[float, float]]:
    """{rows: (first ms, second ms)}: each way over all ``weights`` (``way(x, index)``), interleaved, best of
    ``repeats``, in wall time (the small-M kernel and the packs split a product over threads differently, and CPU
    time counts a thread that spins as busy)."""
    best = {rows: [float("inf"), float("inf")] for rows in row_counts}
    for _ in range(repeats):
        for rows in row_counts:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
            for way, fn in enumerate((first, second)):
                t0 = time.perf_counter()
                for i, w in enumerate(weights):
                    fn(xs[w.shape[1]], i)
                best[rows][way] = min(best[rows][way], time.perf_counter() - t0)
    return {rows: (a * 1e3, b * 1e3) for rows, (a, b) in best.items()}


def choose_packed_max_rows(weights: list[torch.Tensor], layout: str) -> tuple[int, dict[int, tuple[float, float]]]:
    """The most rows ``layout``'s pack should serve on these weights (one orientation), past PACKED_MAX_ROWS.

    The pack and ``F.linear`` on the weight are timed at PREFILL_PROBE_ROWS on a PREFILL_PROBE_BYTES slice (whole
    weights, the last cut to its first rows), best of PREFILL_PROBE_REPEATS. Weights too few to time past the
    caches keep PACKED_MAX_ROWS. Returns the limit and {rows: (pack ms, F.linear ms)} (empty when untimed).
    """
    if sum(w.numel() * w.element_size() for w in weights) < PROBE_MIN_BYTES:
        return PACKED_MAX_ROWS, {}
    probe, budget = [], PREFILL_PROBE_BYTES
    for w in weights:
        if budget <= 0:
            break
        cut = w[: max(1, budget // (w.shape[1] * w.element_size()))]
        probe.append(cut)
        budget -= cut.numel() * cut.element_size()
    packs = [pack_weight(w, layout) for w in probe]
    timed = _time_two_ways(
        probe, PREFILL_PROBE_ROWS, PREFILL_PROBE_REPEATS,
        lambda x, i: _pack_linear(x, packs[i], probe[i], None), lambda x, i: F.linear(x, probe[i]),
    )
    return packed_max_rows_where_faster(timed), timed


def packed_max_rows_where_faster(timed: dict[int, tuple[float, float]]) -> int:
    """The pack's row limit from probe timings {probed rows: (pack, F.linear)}: up to the last probed count of an
    unbroken run of wins from the smallest (a count takes the first probed count's verdict at or above it); every
    count when it won them all, PACKED_MAX_ROWS when it lost the first."""
    max_rows = PACKED_MAX_ROWS
    for rows in sorted(timed):
        pack, plain = timed[rows]
        if pack >= plain:
            return max_rows
        max_rows = rows
    return UNBOUNDED_ROWS if timed else PACKED_MAX_ROWS


def small_m_rows_where_faster(timed: dict[int, tuple[float, float]], low: int = SMALL_M_MIN_ROWS) -> int:
    """The row-count bitmask from probe timings {probed rows: (kernel, other)} over counts from ``low``: a count takes
    the first probed count's verdict at or above it (the kernel when strictly faster); counts above the last probe
    are left to the other way."""
    mask = 0
    for rows in sorted(timed):
        kernel, pack = timed[rows]
        if kernel < pack:
            mask |= sum(1 << r for r in range(low, rows + 1))
        low = rows + 1
    return mask


def pack_weights_for_cpu(model: nn.Module, layout: str = "auto", like: Optional[PackChoice] = None) -> Optional[PackChoice]:
    """Give every opted-in fp32 or bf16 CPU weight of ``model`` a packed copy, in ``layout`` or the probe's choice.

    ``like``: another model's choice on this host (a draft packs like its target: its layout and both timed row
    limits, no probe). Returns the choice (None when nothing was packed). A tied LM head gets its own packed copy
    too (the embedding keeps reading the original).
    """
    modules = [m for m in model.modules() if _packable(m)]
    if not modules:
        return None
    dtypes = {m.weight.dtype for m in modules}
    if len(dtypes) != 1:
        raise ValueError(f"a model's packed weights share one dtype; got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    layouts = available_pack_layouts(dtype)
    if like is not None:
        if like.layout not in layouts:
            raise ValueError(f"CPU pack layout {like.layout!r} (the target's) does not pack these weights (have {layouts})")
        choice = like
        if not like.gguf_rows and gguf_kernel_available() and any(getattr(m, "gguf_weight", None) for m in modules):
            # Blocks the other model had none of (a draft rounded to Q8_0 beside an fp32 target): too few bytes to
            # time, so every count the kernel covers, as choose_gguf_rows gives a small model.
            choice = dataclasses.replace(like, gguf_rows=ALL_GGUF_ROWS)
    elif layout == "auto":
        choice = choose_pack_layout([m.weight for m in modules], layouts)
    elif layout in layouts:
        choice = PackChoice(layout=layout)
    else:
        raise ValueError(f"CPU pack layout {layout!r} is not available for {dtype} weights here (have {layouts})")
    packs = [pack_weight(m.weight, choice.layout) for m in modules]
    if like is None:
        choice = _time_row_limits(choice, modules, packs)
        choice = _time_gguf_rows(choice, modules, packs)
        _log_choice(choice, len(modules))
    for module, packed in zip(modules, packs):
        side = orientation(module.weight)
        gguf = getattr(module, "gguf_weight", None)
        module.packed_weight = PackedWeight(
            packed, choice.small_m_rows[side], choice.packed_max_rows[side], gguf, choice.gguf_rows if gguf else 0
        )
    return choice


def _time_row_limits(choice: PackChoice, modules: list[nn.Module], packs: list[torch.Tensor]) -> PackChoice:
    """``choice`` with the small-M kernel's row counts and the pack's row limit timed per weight orientation."""
    small_m_rows, small_m_probe_ms, packed_max_rows, prefill_probe_ms = {}, {}, {}, {}
    for side in ORIENTATIONS:
        mine = [(m.weight, p) for m, p in zip(modules, packs) if orientation(m.weight) == side]
        weights, side_packs = [w for w, _ in mine], [p for _, p in mine]
        small_m_rows[side], timed = choose_small_m_rows(weights, side_packs)
        if timed:
            small_m_probe_ms[side] = timed
        packed_max_rows[side], timed = choose_packed_max_rows(weights, choice.layout)
        if timed:
            prefill_probe_ms[side] = timed
    return dataclasses.replace(
        choice, small_m_rows=small_m_rows, small_m_probe_ms=small_m_probe_ms, packed_max_rows=packed_max_rows,
        prefill_probe_ms=prefill_probe_ms,
    )


def _time_gguf_rows(choice: PackChoice, modules: list[nn.Module], packs: list[torch.Tensor]) -> PackChoice:
    """``choice`` with the GGUF kernel's row counts timed on the modules that carry GGUF blocks (none: unchanged)."""
    mine = [(m, p) for m, p in zip(modules, packs) if getattr(m, "gguf_weight", None) is not None]
    if not mine:
        return choice
    gguf_rows, timed = choose_gguf_rows([m for m, _ in mine], [p for _, p in mine], choice)
    return dataclasses.replace(choice, gguf_rows=gguf_rows, gguf_probe_ms=timed)


def choose_gguf_rows(
    modules: list[nn.Module], packs: list[torch.Tensor], choice: PackChoice
) -> tuple[int, dict[int, tuple[float, float]]]:
    """The row counts (bitmask) at which the GGUF kernel beats the fp32 route ``choice`` gives these modules.

    Each module carries ``gguf_weight``; ``packs`` are their packed copies. The first GGUF_PROBE_MIN_BYTES of blocks,
    both ways at each of GGUF_PROBE_ROWS, best of GGUF_PROBE_REPEATS; a count between probes takes the verdict of the
    next probed count above it. Too few bytes to time: every count the kernel covers. No kernel: none.
    """
    if not gguf_kernel_available():
        return 0, {}
    probe, size = [], 0
    for module, packed in zip(modules, packs):
        if size >= GGUF_PROBE_MIN_BYTES:
            break
        probe.append((module.weight, module.gguf_weight, packed))
        size += module.gguf_weight.blocks.numel()
    if size < GGUF_PROBE_MIN_BYTES:
        return ALL_GGUF_ROWS, {}

    def fp32_route(x: torch.Tensor, i: int) -> torch.Tensor:
        weight, _, packed = probe[i]
        side = orientation(weight)
        return _linear_with_pack(x, packed, weight, None, choice.small_m_rows[side], choice.packed_max_rows[side])

    timed = _time_two_ways(
        [w for w, _, _ in probe], GGUF_PROBE_ROWS, GGUF_PROBE_REPEATS,
        lambda x, i: gguf_linear(x, probe[i][1].blocks, probe[i][1].ggml_type, None), fp32_route,
    )
    return small_m_rows_where_faster(timed, low=1), timed


def _log_choice(choice: PackChoice, num_weights: int) -> None:
    """The start-up lines that say what the probes timed and chose on this host."""
    if choice.gguf_probe_ms:
        logger.info(
            "CPU GEMM: GGUF kernel on the checkpoint's blocks at rows %s (GGUF kernel / fp32 ms at %s)",
            _row_list(choice.gguf_rows, low=1) or "none",
            ", ".join(f"{rows}: {g:.1f} / {f:.1f}" for rows, (g, f) in choice.gguf_probe_ms.items()),
        )
    for side, timed in choice.small_m_probe_ms.items():
        logger.info(
            "CPU GEMM: small-M kernel on %s weights at rows %s (kernel / %s pack ms, at 1 row kernel / F.linear, at %s)",
            side, _row_list(choice.small_m_rows[side]) or "none", choice.layout,
            ", ".join(f"{rows}: {k:.1f} / {p:.1f}" for rows, (k, p) in timed.items()),
        )
    for side, timed in choice.prefill_probe_ms.items():
        limit = choice.packed_max_rows[side]
        logger.info(
            "CPU GEMM: %s pack on %s weights up to %s rows (pack / F.linear ms at %s)",
            choice.layout, side, "any number of" if limit == UNBOUNDED_ROWS else limit,
            ", ".join(f"{rows}: {p:.1f} / {f:.1f}" for rows, (p, f) in timed.items()),
        )
    if choice.probe_ms:
        timings = ", ".join(f"{name} {ms:.1f} ms" for name, ms in choice.probe_ms.items())
        logger.info(
            "CPU GEMM: %d weights packed for %s (from %d rows); probe over %.0f MB of them at %s rows: %s",
            num_weights, choice.layout, PACKED_MIN_ROWS, choice.probe_bytes / 1e6,
            " and ".join(map(str, PROBE_ROWS)), timings,
        )


def _row_list(mask: int, low: int = SMALL_M_MIN_ROWS) -> str:
    """A row-count bitmask as ranges, e.g. ``2-8, 13-16``."""
    rows = [r for r in range(low, max(SMALL_M_MAX_ROWS, GGUF_MAX_ROWS) + 1) if mask >> r & 1]
    spans: list[list[int]] = []
    for r in rows:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
