"""BaseModelWorker: the one interface the scheduler, PD and the launcher use to reach a model worker.

A worker owns a target ``ModelRunner`` (and, under speculation, a draft runner sharing its slot
allocator and req->token table). The scheduler allocates KV slots and writes them into
``req_to_token`` before calling ``forward_prefill`` / ``forward_decode``; for decode it allocates ``decode_width(bs)``
slots per request, at most ``num_decode_tokens_per_req`` (1, or the verify width W under speculation,
where a step that skips the draft takes 1). The worker returns each request's new token ids (prefill:
1; decode: 1..width, whose K/V it has written at the first slots).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # the launcher imports this module's report helpers in the torch-free front end
    from sglite.srt.managers.schedule_batch import ScheduleBatch
    from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo


class BaseModelWorker(ABC):
    """What the scheduler needs from a model worker (TpModelWorker, DFlashWorker, test fakes)."""

    is_speculative: bool = False
    num_decode_tokens_per_req: int = 1  # slots allocated per request per decode step (1, or the verify width)
    # Speculative workers: drafts one verify proposes, and the last decode step's DFlashStepStats
    # (``verified_drafts`` is fewer than ``num_proposed_drafts`` when cap-accept trimmed the block).
    num_proposed_drafts: int = 0
    last_step: Optional[Any] = None
    # True when the worker fills ``batch.next_token_logprobs`` for return_logprob batches.
    supports_logprobs: bool = False
    # The runners (ModelRunner); test fakes have none. The draft runner shares the target's pools' slots.
    target_runner: Optional[Any] = None
    draft_runner: Optional[Any] = None

    # Seam attributes, read from the target runner and its plan by ``_init_from_target``.
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int

    def _init_from_target(self, target_runner: Any) -> None:
        """Take the pools and the plan's capacities from the target runner (the plan is their one owner)."""
        self.target_runner = target_runner
        self.req_to_token_pool = target_runner.req_to_token_pool
        self.token_to_kv_pool_allocator = target_runner.token_to_kv_pool_allocator
        plan = target_runner.memory_pool_config
        self.max_total_num_tokens = int(plan.max_total_num_tokens)
        self.max_running_requests = int(plan.max_running_requests)
        # The model's context length; the req->token rows are wider (speculative and page slack).
        self.context_len = int(plan.context_len)
        self._last_sampling: tuple[list[Any], Optional["SamplingBatchInfo"]] = ([], None)

    def _sampling_info(self, batch: "ScheduleBatch") -> "SamplingBatchInfo":
        """The batch's SamplingBatchInfo (needs ``vocab_size`` and ``device``); reused across unseeded steps."""
        from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo

        params = batch.sampling_params
        histories = batch.token_histories()
        if histories is not None or any(p.seed is not None for p in params):
            # Seeded requests mix their generated-token count into the seed: fresh noise per step,
            # reproducible whatever shares the batch; penalties follow each step's tokens.
            return SamplingBatchInfo.from_sampling_params(
                params, self.vocab_size, device=self.device, seed_offsets=[len(r.output_ids) for r in batch.reqs],
                histories=histories,
            )
        # Unseeded rows depend on nothing but their params: consecutive decode steps over the same
        # requests reuse one SamplingBatchInfo instead of rebuilding its tensors every step.
        cached_params, cached_info = self._last_sampling
        if len(cached_params) == len(params) and all(a is b for a, b in zip(cached_params, params)):
            return cached_info
        info = SamplingBatchInfo.from_sampling_params(params, self.vocab_size, device=self.device)
        self._last_sampling = (params, info)
        return info

    def mixes_decode(self, num_running: int) -> bool:
        """Whether num_running decoding requests may take one token each inside a prefill EXTEND (mixed chunk).

        A plain worker's decode step is that same one-token forward; a speculative worker says per step
        (``DFlashWorker``: only while its decode steps would skip the draft anyway).
        """
        return not self.is_speculative

    def decode_width(self, batch_size: int) -> int:
        """Slots per request the next decode step of batch_size requests writes (1..num_decode_tokens_per_req).

        The scheduler asks once per decode step, before it allocates; a speculative worker decides here
        whether that step drafts (``DFlashWorker``), and the batch's width tells ``forward_decode``.
        """
        return self.num_decode_tokens_per_req

    def flush_deferred_kv(self) -> None:
        """Write any K/V the worker deferred (none here); the scheduler calls it before a request's slots change hands."""

    @abstractmethod
    def forward_prefill(self, batch: "ScheduleBatch") -> list[list[int]]:
        """Run the prefill; return one sampled token per request (ignored for unfinished chunks)."""

    @abstractmethod
    def forward_decode(self, batch: "ScheduleBatch") -> list[list[int]]:
        """Run one decode step over the batch's slots (``decode_width`` per request); return 1..width new tokens each."""

    def memory_plan(self) -> dict[str, Any]:
        """This rank's memory plan (the target runner's MemoryPoolConfig, draft cell included) as a dict."""
        return dataclasses.asdict(self.target_runner.memory_pool_config)

    @property
    def builds_pools(self) -> bool:
        """Whether the worker owns real KV pools (test fakes have none)."""
        return self.target_runner is not None and getattr(self.target_runner, "token_to_kv_pool", None) is not None

    @property
    def dp_peer_group(self) -> Any:
        """The attention-DP peers whose forwards must stay in lockstep with ours (None without DP attention)."""
        return self.target_runner.dp_peer_group if self.target_runner is not None else None

    def forward_idle(self) -> None:
        """DP attention: take part in the other groups' forward with no tokens of our own."""
        self.target_runner.forward_idle()

    def rank_report(self) -> dict[str, Any]:
        """This rank's report (``build_rank_report``) over the pools its runners allocated."""
        from sglite.srt.runtime_context import get_parallel

        allocated = dict(self.target_runner.kv_pools.allocated_bytes())
        if self.draft_runner is not None:
            allocated.update(self.draft_runner.kv_pools.allocated_bytes())
        return build_rank_report(self.memory_plan(), get_parallel(), allocated)


def build_rank_report(plan: dict[str, Any], par: Any, allocated_pool_bytes: dict[str, int]) -> dict[str, Any]:
    """One rank's widths, KV heads, cell sizes, capacity, and planned vs allocated pool bytes.

    ``plan`` is the MemoryPoolConfig as a dict, ``par`` the rank's ParallelState. A serving rank and a
    rank simulated by `sglite plan` both build their report here, so both print the same line."""
    planned = dict(plan.get("planned_pool_bytes", {}))

    def total(pools: dict[str, int], prefix: str) -> int:
        return sum(v for k, v in pools.items() if k.startswith(prefix))

    return {
        "rank": par.rank,
        "tp_rank": par.tp_rank,
        "dp_rank": par.dp_rank,
        "attn_tp_size": par.attn_tp_size,
        "attn_tp_rank": par.attn_tp_rank,
        "attn_dp_size": par.attn_dp_size,
        "attn_dp_rank": par.attn_dp_rank,
        "target_kv_heads_per_rank": plan.get("target_kv_heads_per_rank"),
        "draft_kv_heads_per_rank": plan.get("draft_kv_heads_per_rank"),
        "target_cell_bytes": plan.get("target_cell_bytes"),
        "draft_cell_bytes": plan.get("draft_cell_bytes"),
        "max_total_num_tokens": plan.get("max_total_num_tokens"),
        "planned_pool_bytes": planned,
        "allocated_pool_bytes": dict(allocated_pool_bytes),
        "planned_target_kv_bytes": total(planned, "target_"),
        "planned_draft_kv_bytes": total(planned, "draft_"),
        "allocated_target_kv_bytes": total(allocated_pool_bytes, "target_"),
        "allocated_draft_kv_bytes": total(allocated_pool_bytes, "draft_"),
    }


def format_rank_report(report: dict[str, Any]) -> str:
    """One start-up log line for a rank's report."""
    return (
        f"rank {report['rank']} (dp_rank {report['dp_rank']}): attn_tp_size={report['attn_tp_size']} "
        f"attn_dp_size={report['attn_dp_size']} target_kv_heads={report['target_kv_heads_per_rank']} "
        f"draft_kv_heads={report['draft_kv_heads_per_rank']} target_cell_bytes={report['target_cell_bytes']} "
        f"draft_cell_bytes={report['draft_cell_bytes']} max_total_num_tokens={report['max_total_num_tokens']} "
        f"target_kv planned/allocated={report['planned_target_kv_bytes']}/{report['allocated_target_kv_bytes']} "
        f"draft_kv planned/allocated={report['planned_draft_kv_bytes']}/{report['allocated_draft_kv_bytes']}"
    )
