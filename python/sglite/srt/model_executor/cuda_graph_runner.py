"""CUDA graphs for forwards of fixed shape: DECODE, and DFLASH TARGET_VERIFY / DRAFT_BLOCK blocks.

A ``CudaGraphRunner`` belongs to one ``ModelRunner`` and one ``ForwardMode``. At start-up it captures
the model forward once per batch-size bucket (1, 2, 4, 8, then multiples of 8 up to
``--cuda-graph-max-bs``) over static input buffers sized for the largest bucket. A replay copies the
real batch into those buffers, pads it up to the bucket (pad request = req_to_token row 0, the dummy
row; pad tokens write K/V only at slot 0, the allocator's reserved padding slot, and see a valid
sequence of ``tokens_per_req`` keys there), runs the graph and returns the real rows of its outputs.

The outputs are views of the runner's one set of output buffers (every bucket's graph ends by copying
its outputs there): they stay valid until this runner's next replay. Captured graphs read nothing
but the static buffers and the attention backend's persistent metadata buffers; the backend
refreshes the latter in ``init_forward_metadata_replay_cuda_graph`` outside the graph, never with a
host sync inside it.

Graph execution sits behind a two-method object (``capture(fn) -> outputs``, ``replay()``):
``CudaGraph`` wraps ``torch.cuda.CUDAGraph`` (warm-up runs, one shared memory pool); the CPU test
double ``EagerReplayGraph`` re-runs the captured callable and writes its results into the captured
output tensors, so a forward that reads anything besides the static buffers shows up as a mismatch
against the plain eager forward. ModelRunner builds graph runners only on CUDA
(``build_cuda_graph_runners``); the double is for tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from sglite.srt.layers.logits_processor import LogitsProcessorOutput
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)

# Modes a graph can capture; EXTEND has data-dependent shapes and IDLE has nothing to run.
GRAPH_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK)


# ---------------------------------------------------------------------- batch-size buckets
def capture_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's buckets: 1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (``max_bs`` itself included)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def bucket_for(batch_size: int, batch_sizes: Sequence[int]) -> int:
    """The smallest captured batch size that holds ``batch_size`` requests."""
    for b in sorted(batch_sizes):
        if b >= batch_size:
            return b
    raise ValueError(f"batch size {batch_size} exceeds the largest captured batch {max(batch_sizes)}")


# ---------------------------------------------------------------------- graph executors
class GraphExecutor(Protocol):
    """Captures a no-argument callable once and replays it."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Capture ``fn`` and return its outputs (the tensors a replay refreshes in place)."""

    def replay(self) -> None:
        """Run the captured work again over the same input buffers, refreshing the captured outputs."""


_GRAPH_MEMORY_POOL: Any = None


def graph_memory_pool() -> Any:
    """The one CUDA-graph memory pool every graph of this process captures into (graphs replay one at a time)."""
    global _GRAPH_MEMORY_POOL
    if _GRAPH_MEMORY_POOL is None:
        _GRAPH_MEMORY_POOL = torch.cuda.graph_pool_handle()
    return _GRAPH_MEMORY_POOL


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the executor interface: warm-up runs on a side stream, then capture."""

    def __init__(self, num_warmup: int = 2, pool: Any = None) -> None:
        self.num_warmup = num_warmup
        self.pool = pool
        self._graph: Optional[torch.cuda.CUDAGraph] = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Warm up (autotuning and lazy allocations happen here, outside the graph), then capture ``fn``."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.num_warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pool = self.pool if self.pool is not None else graph_memory_pool()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
        torch.cuda.synchronize()
        self._graph = graph
        return out

    def replay(self) -> None:
        """Launch the captured graph on the current stream."""
        if self._graph is None:
            raise RuntimeError("CudaGraph.replay before capture")
        self._graph.replay()


class HostSyncError(RuntimeError):
    """A captured forward read a device value on the host (a real CUDA graph capture would fail or bake it in)."""


# aten ops that read tensor values on the host or give data-dependent shapes.
_HOST_SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique")


class _NoHostSync(TorchDispatchMode):
    """Raises HostSyncError on ``.item()``/``int()``/``bool()`` of a tensor, nonzero, boolean-mask indexing, ``.tolist()``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(_HOST_SYNC_OPS) or (
            name.startswith(("aten.index.", "aten.index_put")) and _has_bool_index(args)
        ):
            raise HostSyncError(f"{name} inside a captured forward (host sync or data-dependent shape)")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def _refuse(t: torch.Tensor) -> Any:
            raise HostSyncError("Tensor.tolist() inside a captured forward (host sync)")

        torch.Tensor.tolist = _refuse  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class EagerReplayGraph:
    """CPU test double: replay re-runs the captured callable and copies its results into the captured outputs.

    It checks the static-buffer discipline of what is captured: a callable that reads only the static
    buffers gives, re-run after the buffers are refilled, what a real graph replay would. Capture and
    replay run under a guard that raises ``HostSyncError`` on host reads of device values (``.item()``,
    ``int()``/``bool()`` of a tensor, ``.tolist()``, nonzero, boolean-mask indexing).
    """

    def __init__(self) -> None:
        self._fn: Optional[Callable[[], Any]] = None
        self._out: Any = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once (host syncs refused) and keep it and its outputs."""
        self._fn = fn
        with _NoHostSync():
            self._out = fn()
        return self._out

    def replay(self) -> None:
        """Re-run the callable and write its outputs into the tensors ``capture`` returned."""
        if self._fn is None:
            raise RuntimeError("EagerReplayGraph.replay before capture")
        with _NoHostSync():
            out = self._fn()
        _copy_into(self._out, out)
        self.num_replays += 1


def _copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` in place: tensors, dataclasses of tensors (None fields must match)."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            raise RuntimeError(f"a replay produced {getattr(src, 'shape', src)} where the capture produced {tuple(dst.shape)}")
        dst.copy_(src)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))
    elif dst is None:
        if src is not None:
            raise RuntimeError("a replay produced an output the capture did not")
    else:
        raise TypeError(f"cannot refresh a captured output of type {type(dst).__name__}")


GraphFactory = Callable[[], GraphExecutor]


# ---------------------------------------------------------------------- what to capture
@dataclass(frozen=True)
class CudaGraphSpec:
    """One graph runner's shape: mode, new tokens per request, captured aux layers, batch-size buckets."""

    mode: ForwardMode
    tokens_per_req: int
    batch_sizes: tuple[int, ...]
    capture_aux_hidden_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"CUDA graphs capture {[m.name for m in GRAPH_MODES]}, not {self.mode.name}")
        if self.mode == ForwardMode.DECODE and self.tokens_per_req != 1:
            raise ValueError(f"DECODE graphs take one token per request, got {self.tokens_per_req}")
        if self.tokens_per_req < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"bad CUDA graph shape: {self.tokens_per_req} tokens/request, batch sizes {self.batch_sizes}")


@dataclass(frozen=True)
class CudaGraphPlan:
    """What ``plan_cuda_graphs`` decided for one runner: the specs to capture, or why none (``reason``)."""

    specs: tuple[CudaGraphSpec, ...] = ()
    reason: str = ""


def plan_cuda_graphs(
    server_args: Any,
    *,
    device_type: str,
    attn_backend: Any,
    is_draft: bool,
    model_config: Any,
    spec_aux_config: Any,
    max_running_requests: int,
    attn_dp_size: int = 1,
) -> CudaGraphPlan:
    """Which graphs a runner captures: DECODE for a plain target, TARGET_VERIFY (with aux capture) for a
    DFLASH/DSPARK target, DRAFT_BLOCK for its draft; none (with the reason) when graphs cannot run."""
    if device_type != "cuda":
        return CudaGraphPlan(reason=f"device is {device_type}; CUDA graphs are CUDA-only")
    if server_args.disable_cuda_graph:
        return CudaGraphPlan(reason="--disable-cuda-graph is set")
    if server_args.enable_dp_attention and attn_dp_size > 1:
        return CudaGraphPlan(
            reason=f"--enable-dp-attention with attn_dp_size {attn_dp_size}: the cross-DP-group token gather pads "
            "to data-dependent sizes, so forwards stay eager"
        )
    if server_args.disaggregation_mode == "prefill":
        return CudaGraphPlan(reason="a PD prefill node (--disaggregation-mode prefill) never decodes")
    if not getattr(attn_backend, "supports_cuda_graph", False):
        return CudaGraphPlan(
            reason=f"attention backend {type(attn_backend).__name__} does not support CUDA graphs "
            "(use --attention-backend triton for graphs)"
        )
    max_bs = min(int(server_args.cuda_graph_max_bs), int(max_running_requests))
    sizes = tuple(capture_batch_sizes(max_bs))
    algo = server_args.speculative_algorithm
    # B and the verify width come from the spec config (resolve_block_geometry), never re-derived here.
    if is_draft:
        return CudaGraphPlan(specs=(CudaGraphSpec(ForwardMode.DRAFT_BLOCK, spec_aux_config.draft_block_size, sizes),))
    if SpeculativeAlgorithm.from_string(algo).is_dflash_family():
        layers = tuple(int(i) for i in spec_aux_config.target_layer_ids)
        spec = CudaGraphSpec(ForwardMode.TARGET_VERIFY, spec_aux_config.num_verify_tokens, sizes, layers)
        return CudaGraphPlan(specs=(spec,))
    return CudaGraphPlan(specs=(CudaGraphSpec(ForwardMode.DECODE, 1, sizes),))


_LOGGED_OFF_REASONS: set[str] = set()


def build_cuda_graph_runners(model_runner: Any) -> list["CudaGraphRunner"]:
    """The graph runners ModelRunner uses (CUDA only); when none, the reason is logged once per process."""
    parallel = model_runner.parallel
    plan = plan_cuda_graphs(
        model_runner.server_args,
        device_type=model_runner.device.type,
        attn_backend=model_runner.attn_backend,
        is_draft=model_runner.is_draft,
        model_config=model_runner.model_config,
        spec_aux_config=model_runner.spec_aux_config,
        max_running_requests=model_runner.memory_pool_config.max_running_requests,
        attn_dp_size=int(getattr(parallel, "attn_dp_size", 1)),
    )
    if not plan.specs:
        if plan.reason not in _LOGGED_OFF_REASONS:
            _LOGGED_OFF_REASONS.add(plan.reason)
            logger.info("CUDA graphs off: %s", plan.reason)
        return []
    show = getattr(model_runner, "tp_rank", 0) == 0
    return [CudaGraphRunner(model_runner, spec, graph_factory=CudaGraph, show_progress=show) for spec in plan.specs]


# ---------------------------------------------------------------------- the runner
@dataclass
class _StaticInputs:
    """Input buffers every graph of one runner reads (views ``[:bucket]`` / ``[:bucket * tokens_per_req]``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    pad_positions: torch.Tensor  # positions of pad tokens: 0..tokens_per_req-1 per pad request


class CudaGraphRunner:
    """Captured forwards of one mode at fixed shapes for one ModelRunner; ``can_run`` + ``replay``."""

    def __init__(
        self,
        model_runner: Any,
        spec: CudaGraphSpec,
        *,
        graph_factory: GraphFactory,
        show_progress: bool = False,
    ) -> None:
        self.model_runner = model_runner
        self.spec = spec
        self.mode = spec.mode
        self.tokens_per_req = spec.tokens_per_req
        self.batch_sizes = tuple(sorted(set(spec.batch_sizes)))
        self.max_bs = self.batch_sizes[-1]
        self.capture_aux_hidden_layers = (
            list(spec.capture_aux_hidden_layers) if spec.capture_aux_hidden_layers else None
        )
        self.attn_backend = model_runner.attn_backend
        self.device = torch.device(model_runner.device)
        if not getattr(self.attn_backend, "supports_cuda_graph", False):
            raise ValueError(
                f"attention backend {type(self.attn_backend).__name__} cannot be captured in CUDA graphs; "
                "use --attention-backend triton or --disable-cuda-graph"
            )
        self._check_executor(graph_factory)
        self.graph_factory = graph_factory
        table = model_runner.req_to_token_pool.req_to_token
        if self.tokens_per_req > table.shape[1]:
            raise ValueError(f"{self.tokens_per_req} tokens per request exceed the req_to_token rows ({table.shape[1]})")
        if bool(table[0, : self.tokens_per_req].any()):
            # Pad requests read req_to_token row 0; it must point at the padding slot 0 only.
            raise RuntimeError("req_to_token row 0 (the dummy row pad requests read) holds real slots")
        self.inputs = self._alloc_inputs()
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.tokens_per_req)
        self.graphs: dict[int, GraphExecutor] = {}
        self.outputs: dict[int, LogitsProcessorOutput] = {}
        self.static_batches: dict[int, ForwardBatch] = {}
        self.num_replays = 0  # forwards served by a graph (tests and logs)
        self._out_bufs: Optional[dict[str, torch.Tensor]] = None  # shared by every bucket's graph
        self.capture(show_progress)

    def _check_executor(self, graph_factory: GraphFactory) -> None:
        # Real graphs need CUDA; the eager double must never stand in for them on CUDA.
        if graph_factory is CudaGraph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        if graph_factory is EagerReplayGraph and self.device.type == "cuda":
            raise ValueError("EagerReplayGraph is a CPU test double; on CUDA use CudaGraph")

    # ------------------------------------------------------------------ buffers
    def _alloc_inputs(self) -> _StaticInputs:
        n = self.max_bs * self.tokens_per_req
        dev, i64 = self.device, torch.int64
        pad_positions = torch.arange(self.tokens_per_req, dtype=i64, device=dev).repeat(self.max_bs)
        return _StaticInputs(
            input_ids=torch.zeros(n, dtype=i64, device=dev),
            positions=pad_positions.clone(),
            out_cache_loc=torch.zeros(n, dtype=i64, device=dev),
            req_pool_indices=torch.zeros(self.max_bs, dtype=i64, device=dev),
            seq_lens=torch.full((self.max_bs,), self.tokens_per_req, dtype=i64, device=dev),
            extend_prefix_lens=torch.zeros(self.max_bs, dtype=i64, device=dev),
            extend_seq_lens=torch.full((self.max_bs,), self.tokens_per_req, dtype=i64, device=dev),
            pad_positions=pad_positions,
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A ForwardBatch of ``bs`` pad requests whose tensors are views of the static buffers."""
        s, n, runner = self.inputs, bs * self.tokens_per_req, self.model_runner
        return ForwardBatch(
            forward_mode=self.mode,
            batch_size=bs,
            input_ids=s.input_ids[:n],
            positions=s.positions[:n],
            req_pool_indices=s.req_pool_indices[:bs],
            seq_lens=s.seq_lens[:bs],
            extend_prefix_lens=s.extend_prefix_lens[:bs],
            extend_seq_lens=s.extend_seq_lens[:bs],
            out_cache_loc=s.out_cache_loc[:n],
            # Shapes only: what a captured graph may depend on on the host (values are the pad batch's).
            seq_lens_cpu=[self.tokens_per_req] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[self.tokens_per_req] * bs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=self.attn_backend,
            capture_aux_hidden_layers=self.capture_aux_hidden_layers,
        )

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self, show_progress: bool = False) -> None:
        """Capture one graph per bucket, largest first (scratch buffers reach full size on the first)."""
        cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        t0 = time.perf_counter()
        model = self.model_runner.model
        sizes = list(reversed(self.batch_sizes))
        bar = tqdm(sizes, desc=f"Capturing CUDA graphs ({self.mode.name})", disable=not show_progress)
        for bs in bar:
            fb = self._static_batch(bs)
            self.attn_backend.init_forward_metadata_capture_cuda_graph(fb)
            graph = self.graph_factory()

            def run(fb: ForwardBatch = fb) -> LogitsProcessorOutput:
                return self._into_static_outputs(model.forward(fb.input_ids, fb.positions, fb), fb.batch_size)

            self.outputs[bs] = graph.capture(run)
            self.graphs[bs] = graph
            self.static_batches[bs] = fb
        if cuda:
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info(
                "captured %d CUDA graphs (%s, %d tokens/request, batch sizes %s) in %.1f s, %.2f GiB",
                len(sizes), self.mode.name, self.tokens_per_req, list(self.batch_sizes),
                time.perf_counter() - t0, used / (1 << 30),
            )

    def _into_static_outputs(self, out: LogitsProcessorOutput, bs: int) -> LogitsProcessorOutput:
        """Copy a forward's outputs into this runner's one set of output buffers; returns views of them.

        Every bucket writes the same buffers, so a runner holds one largest-bucket output (with a big
        vocabulary, verify logits are ``bs * B`` fp32 rows) instead of one per bucket; a replay's
        outputs stay valid until this runner's next replay.
        """
        n = bs * self.tokens_per_req
        rows = n if self.mode.returns_all_token_logits() else bs
        fields = {"next_token_logits": rows, "hidden_states": rows, "aux_hidden_states": n}
        if self._out_bufs is None:
            # Largest bucket first: its shapes size the buffers, outside any capture (CUDA: a warm-up run).
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("CUDA graph output buffers must be allocated by a warm-up run, not during capture")
            if bs != self.max_bs:
                raise RuntimeError(f"the first captured batch must be the largest ({self.max_bs}), got {bs}")
            self._out_bufs = {
                name: t.new_empty(t.shape) for name in fields if (t := getattr(out, name)) is not None
            }
        views = {}
        for name, k in fields.items():
            t = getattr(out, name)
            buf = self._out_bufs.get(name)
            if (t is None) != (buf is None) or (t is not None and (t.shape[0] != k or t.shape[1:] != buf.shape[1:])):
                raise RuntimeError(f"graph output {name} has shape {None if t is None else tuple(t.shape)}; expected {k} rows")
            if t is not None:
                views[name] = buf[:k]
                views[name].copy_(t)
        return dataclasses.replace(out, **views)

    # ------------------------------------------------------------------ replay
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether this batch fits a captured graph (mode, size, block shape, aux layers, backend, pool)."""
        fb = forward_batch
        if fb.forward_mode != self.mode or not 1 <= fb.batch_size <= self.max_bs:
            return False
        if fb.attn_backend is not None and fb.attn_backend is not self.attn_backend:
            return False
        if fb.token_to_kv_pool is not None and fb.token_to_kv_pool is not self.model_runner.token_to_kv_pool:
            return False
        if fb.input_embeds is not None:
            return False  # graphs capture the token-id path (the embedding lookup is inside the graph)
        if fb.aux_layers() != self.capture_aux_hidden_layers:
            return False
        if fb.input_ids.numel() != fb.batch_size * self.tokens_per_req:
            return False
        return all(int(n) == self.tokens_per_req for n in fb.extend_seq_lens_cpu)

    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Copy the batch in, pad to its bucket, replay, and return the real rows (views of the output buffers)."""
        fb, s = forward_batch, self.inputs
        bs = fb.batch_size
        padded_bs = bucket_for(bs, self.batch_sizes)
        n, padded_n = bs * self.tokens_per_req, padded_bs * self.tokens_per_req
        s.input_ids[:n].copy_(fb.input_ids)
        s.positions[:n].copy_(fb.positions)
        s.out_cache_loc[:n].copy_(fb.out_cache_loc)
        s.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        s.seq_lens[:bs].copy_(fb.seq_lens)
        s.extend_prefix_lens[:bs].copy_(fb.extend_prefix_lens)
        if padded_bs > bs:
            # Pad requests: dummy row 0, tokens at positions 0..B-1 writing only slot 0, B keys (all slot 0).
            s.input_ids[n:padded_n].zero_()
            s.positions[n:padded_n].copy_(s.pad_positions[: padded_n - n])
            s.out_cache_loc[n:padded_n].zero_()
            s.req_pool_indices[bs:padded_bs].zero_()
            s.seq_lens[bs:padded_bs].fill_(self.tokens_per_req)
            s.extend_prefix_lens[bs:padded_bs].zero_()
        self.attn_backend.init_forward_metadata_replay_cuda_graph(self.static_batches[padded_bs])
        self.graphs[padded_bs].replay()
        self.num_replays += 1
        return self._real_rows(self.outputs[padded_bs], bs, n)

    def _real_rows(self, out: LogitsProcessorOutput, bs: int, n: int) -> LogitsProcessorOutput:
        rows = n if self.mode.returns_all_token_logits() else bs

        def head(t: Optional[torch.Tensor], k: int) -> Optional[torch.Tensor]:
            return None if t is None else t[:k]

        return dataclasses.replace(
            out,
            next_token_logits=out.next_token_logits[:rows],
            hidden_states=head(out.hidden_states, rows),
            aux_hidden_states=head(out.aux_hidden_states, n),
        )

