"""ModelRunner: one model on one rank, with its KV pools and attention backend (docs/memory_plan.md).

Target start-up order: init_parallel_runtime → measure memory → load weights → resolve the draft's
aux hidden-state / KV price → size the pools → allocate pools → attention backend → CUDA graphs
(CUDA only, ``cuda_graph_runner.py``). A draft runner
(``is_draft=True``) reuses the target's groups, pool plan, slot allocator and req→token table and
builds only its own KV pool, of its own geometry, at the target's ``max_total_num_tokens``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from sglite.srt.configs.gguf import find_gguf_file
from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.bootstrap import init_parallel_runtime
from sglite.srt.distributed.parallel_state import GroupCoordinator, get_attn_dp_peer_group, get_tp_group
from sglite.srt.layers.attention.registry import create_attention_backend
from sglite.srt.layers.attention.cpu_paged_attention import start_building_paged_attention_kernel
from sglite.srt.layers.cpu_bf16_projection import BF16_PROJECTION_MIN_ROWS, bf16_gemm_is_native
from sglite.srt.layers.cpu_gemm import PackChoice, pack_weights_for_cpu, prepare_cpu_gemm
from sglite.srt.layers.hot_vocab_head import load_token_map
from sglite.srt.layers.logits_processor import LogitsProcessorOutput
from sglite.srt.layers.sampler import Sampler
from sglite.srt.mem_cache.kv_cache_dtype import model_runtime_dtype
from sglite.srt.model_executor.kv_cache_configurator import (
    KVBudgetInputs,
    KVCacheConfigurator,
    build_pools,
    check_plan_matches_rank,
    get_free_device_memory,
    min_across_group,
    plan_and_build_pools,
)
from sglite.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    build_forward_batch,
    idle_forward_batch,
)
from sglite.srt.model_executor.compiled_decode_runner import build_compiled_decode_runner
from sglite.srt.model_executor.cuda_graph_runner import CudaGraphRunner, build_cuda_graph_runners
from sglite.srt.model_loader.gguf_weights import draft_model_quantization, quantize_linears_to_q8_0
from sglite.srt.model_loader.loader import load_model
from sglite.srt.runtime_context import get_parallel
from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads a model for this rank, owns (or shares) its KV pools, runs forwards and samples."""

    def __init__(
        self,
        server_args: ServerArgs,
        *,
        model_path: Optional[str] = None,
        is_draft: bool = False,
        target_runner: Optional["ModelRunner"] = None,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: Optional[str] = None,
        dp_rank: int = 0,
    ) -> None:
        self.server_args = server_args
        self.is_draft = is_draft
        self.target_runner = target_runner
        if is_draft and target_runner is None:
            raise ValueError("a draft ModelRunner needs target_runner= (it shares the target's pools and groups)")
        if not is_draft and target_runner is not None:
            raise ValueError("target_runner= is only for draft runners (is_draft=True)")
        path = model_path or (server_args.speculative_draft_model_path if is_draft else server_args.model_path)
        if path is None:
            flag = "--speculative-draft-model-path" if is_draft else "--model-path"
            raise ValueError(f"ModelRunner needs a model directory: set {flag} (or pass model_path=)")
        self.model_path = path
        self.model_config = ModelConfig.from_path(path)
        # A draft reads the target's hidden states and shares its embedding and LM head, and the plan prices
        # its KV in the target's dtype; so under --dtype auto it runs in the target's dtype, whatever its
        # checkpoint stores (a bf16-stored draft of an fp32 target is upcast, losslessly).
        if is_draft and server_args.dtype in (None, "auto"):
            self.dtype = target_runner.dtype
        else:
            self.dtype = model_runtime_dtype(server_args.dtype, self.model_config)

        # 1. Parallel runtime (a draft reuses the target's groups).
        if is_draft:
            self.parallel = get_parallel()
        else:
            self.parallel = init_parallel_runtime(
                server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
            )
        self.tp_rank = self.parallel.tp_rank
        self.tp_size = self.parallel.tp_size
        self.device = self._resolve_device()

        # 2. Memory before weights.
        self._free_bytes_before_load = None if is_draft else self._measure_free_memory()

        # 3. Weights (a first start on a CPU host compiles the small-M GEMM kernel meanwhile, and the compiled forwards'
        # attention kernel under --enable-torch-compile; the target's suffice).
        if not is_draft:
            prepare_cpu_gemm(self.device, self.dtype, reads_gguf=find_gguf_file(path) is not None)
            if self.device.type == "cpu" and server_args.enable_torch_compile:
                start_building_paged_attention_kernel()
        self.model = load_model(
            self.model_config, path, self.device, self.dtype, show_progress=self.tp_rank == 0 and not is_draft
        )
        if is_draft and hasattr(self.model, "attach_target_head"):
            target_model = target_runner.model
            self.model.attach_target_head(
                target_model.get_embed_tokens(), target_model.get_lm_head(), target_model.logits_processor
            )
            if server_args.speculative_token_map is not None:  # before packing: the hot head packs with the draft
                self.model.restrict_draft_vocab(
                    load_token_map(server_args.speculative_token_map, target_runner.model_config.vocab_size)
                )
        if is_draft and draft_model_quantization(
            server_args.speculative_draft_model_quantization, path, self.device
        ) == "q8_0":  # before packing: the blocks are what the pack routes rows to
            quantize_linears_to_q8_0(self.model)
            if bf16_gemm_is_native() and hasattr(self.model, "project_context_in_bf16"):
                # The same trade as the Q8_0 rounding (drafts may move, output cannot): the context writes a
                # draft-free step still owes the draft cost half as much.
                copies = self.model.project_context_in_bf16()
                logger.info("Draft context writes of >= %d rows project in bf16 (the CPU has bf16 dot products; "
                            "copies %.1f MB)", BF16_PROJECTION_MIN_ROWS, copies / 2**20)
        # The CPU pack layout and the small-M kernel's row counts are facts of the host, timed once on the target's
        # weights: a draft (too few layers to time past the caches) packs like its target.
        self.cpu_pack: Optional[PackChoice] = None
        if self.device.type == "cpu":
            self.cpu_pack = pack_weights_for_cpu(self.model, like=target_runner.cpu_pack if is_draft else None)

        # 4. What the target captures for its draft, and the draft's exact KV price (live attn_tp width).
        # 5. The pool plan, then the pools (a draft reuses the target's plan, allocator and request table).
        if is_draft:
            self.spec_aux_config = target_runner.spec_aux_config
            self.memory_pool_config = KVCacheConfigurator(
                server_args,
                self.model_config,
                self.spec_aux_config,
                model_dtype=self.dtype,
                is_draft=True,
                target_memory_pool_config=target_runner.memory_pool_config,
                device=str(self.device),
            ).configure()
            check_plan_matches_rank(self.memory_pool_config)
            pools = build_pools(
                self.memory_pool_config,
                self.model_config,
                device=str(self.device),
                is_draft=True,
                target_pools=target_runner.kv_pools,
            )
            self.kv_cache_dtype = self.memory_pool_config.draft_kv_cache_torch_dtype
        else:
            on_cuda = self.device.type == "cuda"  # CPU has no memory profile: its budget is a flag
            budget = KVBudgetInputs(
                tp_group=get_tp_group(),
                pre_model_load_free_bytes=self._free_bytes_before_load if on_cuda else None,
                post_model_load_free_bytes=get_free_device_memory(str(self.device)) if on_cuda else None,
            )
            planned = plan_and_build_pools(
                server_args, self.model_config, pool_device=str(self.device), model_dtype=self.dtype, budget=budget
            )
            self.spec_aux_config, self.memory_pool_config = planned.spec_aux_config, planned.memory_pool_config
            pools = planned.target
            self.kv_cache_dtype = self.memory_pool_config.kv_cache_torch_dtype
        self.kv_pools = pools
        self.token_to_kv_pool = pools.token_to_kv_pool
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool_allocator = pools.token_to_kv_pool_allocator

        # 6. Attention backend, then CUDA graphs (decode / DFLASH verify / draft block; none off CUDA).
        backend_name = server_args.resolved_attention_backend()
        if is_draft and server_args.speculative_draft_attention_backend:
            backend_name = server_args.speculative_draft_attention_backend
        self.attn_backend = create_attention_backend(backend_name, self)
        self.sampler = Sampler(seed=server_args.random_seed)
        self.cuda_graph_runners: list[CudaGraphRunner] = build_cuda_graph_runners(self)
        # 7. CPU: the compiled decode step (--enable-torch-compile), compiled now so no request waits on it.
        self.compiled_decode = build_compiled_decode_runner(self)
        if self.compiled_decode is not None:
            self.compiled_decode.warm_up()

    # ------------------------------------------------------------------ start-up helpers
    def _resolve_device(self) -> torch.device:
        name = self.server_args.resolved_device()
        if name == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(name)

    def _measure_free_memory(self) -> Optional[int]:
        """CUDA: free bytes, minimum over the TP group (every rank sizes alike). CPU: None (budget flag)."""
        if self.device.type != "cuda":
            return None
        return min_across_group(get_free_device_memory(str(self.device)), get_tp_group())

    # ------------------------------------------------------------------ running
    def build_forward_batch(
        self,
        mode: ForwardMode,
        reqs: Sequence[Any],
        *,
        out_cache_loc: Optional[torch.Tensor] = None,
        capture_aux_hidden_layers: Optional[list[int]] = None,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> ForwardBatch:
        """A ForwardBatch over this runner's pools for (req_row, prefix_len, new_token_ids) triples."""
        return build_forward_batch(
            mode,
            reqs,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            allocator=self.token_to_kv_pool_allocator,
            attn_backend=self.attn_backend,
            out_cache_loc=out_cache_loc,
            capture_aux_hidden_layers=capture_aux_hidden_layers,
            input_embeds=input_embeds,
            device=self.device,
        )

    @torch.no_grad()
    def forward_idle(self, capture_aux_hidden_layers: Optional[list[int]] = None) -> LogitsProcessorOutput:
        """A zero-token forward: takes part in DP attention's cross-group exchanges without a batch."""
        return self.forward(
            idle_forward_batch(
                self.device,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=self.token_to_kv_pool,
                attn_backend=self.attn_backend,
                capture_aux_hidden_layers=capture_aux_hidden_layers,
            )
        )

    @property
    def dp_peer_group(self) -> Optional[GroupCoordinator]:
        """The attention-DP peers this runner's forwards exchange tokens with (None without DP attention)."""
        peers = get_attn_dp_peer_group()
        return peers if peers.world_size > 1 else None

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run the model; logits one row per request (EXTEND/DECODE) or per token (VERIFY/DRAFT_BLOCK)."""
        if forward_batch.token_to_kv_pool is None:
            forward_batch.token_to_kv_pool = self.token_to_kv_pool
        if forward_batch.req_to_token_pool is None:
            forward_batch.req_to_token_pool = self.req_to_token_pool
        if forward_batch.attn_backend is None:
            forward_batch.attn_backend = self.attn_backend
        if forward_batch.token_to_kv_pool is not self.token_to_kv_pool:
            raise ValueError("forward_batch.token_to_kv_pool is another runner's pool (target vs draft mix-up)")
        for graph_runner in self.cuda_graph_runners:
            if graph_runner.can_run(forward_batch):
                return graph_runner.replay(forward_batch)
        if self.compiled_decode is not None and self.compiled_decode.can_run(forward_batch):
            return self.compiled_decode.run(forward_batch)
        forward_batch.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def sample(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Next token ids ``[rows]`` from fp32 logits (greedy / temperature / top-k / top-p / min-p)."""
        return self.sampler(logits, sampling_info)
