"""Req (one request's scheduling state) and ScheduleBatch (one forward's worth of requests).

KV bookkeeping of a Req, by token position in its ``req_to_token`` row:
- ``[0, prefix_len)``: slots owned by the prefix cache (matched at admission, locked at ``last_node``);
- ``[prefix_len, kv_len)``: slots the request allocated itself and whose K/V are computed;
- all positions sharing a page with a position ``< kv_len`` belong to the request too (pages are
  position-aligned: position i lives at offset ``i % page_size`` of its page).
After prefill completes and after every decode step ``kv_len == len(all_token_ids) - 1``: the newest
token has no K/V yet, it is the input of the next decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglite.srt.managers.io_struct import FinishReason
from sglite.srt.mem_cache.base_prefix_cache import empty_indices
from sglite.srt.sampling.sampling_params import SamplingParams


@dataclass
class Req:
    """Scheduling state of one request."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    input_text: Optional[str] = None
    stream: bool = False
    return_logprob: bool = False
    output_token_logprobs: list[float] = field(default_factory=list)  # one per output token when asked
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[FinishReason] = None

    # KV placement (see the module docstring).
    req_pool_idx: Optional[int] = None
    prefix_indices: torch.Tensor = field(default_factory=empty_indices)
    last_node: Any = None
    kv_len: int = 0

    # Reporting.
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    admitted_once: bool = False
    num_retractions: int = 0
    sent_len: int = 0  # output tokens already sent to the detokenizer
    spec_verify_ct: int = 0  # target verify forwards (speculative decoding)
    spec_accepted_tokens: int = 0  # tokens produced by those verify forwards (accepted drafts + bonus)
    spec_verified_drafts: int = 0  # drafts those verify forwards scored (fewer than proposed when capped)
    spec_capped_ct: int = 0  # verify forwards the cap-accept mode trimmed
    arrival_time: float = field(default_factory=time.monotonic)

    # PD disaggregation: where the prefill node's bootstrap server is and which room pairs the nodes.
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None

    # ------------------------------------------------------------------ derived
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (what a re-prefill after retraction computes)."""
        return self.origin_input_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        """The newest token (the next decode input), without building ``all_token_ids``."""
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    @property
    def seq_len(self) -> int:
        """Prompt + generated tokens."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prefix_len(self) -> int:
        """Tokens whose slots come from the prefix cache."""
        return int(self.prefix_indices.numel())

    @property
    def finished(self) -> bool:
        """A finish reason is set."""
        return self.finished_reason is not None

    def reset_kv_state(self) -> None:
        """Forget KV placement (after the slots were released): the request will prefill again."""
        self.req_pool_idx = None
        self.prefix_indices = empty_indices()
        self.last_node = None
        self.kv_len = 0


@dataclass
class ScheduleBatch:
    """The requests of one forward and the KV slots of their new tokens.

    ``prefix_lens[i]`` is request i's K/V length before the forward; ``input_ids`` are the new tokens
    (prefill: ``extend_lens[i]`` tokens of the prompt; decode: each request's newest token);
    ``out_cache_loc`` holds the slots allocated for the forward, ``extend_lens[i]`` per request in
    request order (decode: ``num_decode_tokens_per_req`` each, so a speculative worker can verify a
    block there). ``req_to_token[row, prefix:prefix+extend]`` already holds those slots.
    """

    reqs: list[Req]
    is_prefill: bool
    input_ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    # Filled by a worker with ``supports_logprobs`` when ``return_logprob``: per request, the log-probability
    # (log_softmax of the raw logits) of each token it returned, aligned with the returned token ids.
    next_token_logprobs: Optional[list[list[float]]] = None

    @property
    def return_logprob(self) -> bool:
        """Whether any request of the batch asked for logprobs."""
        return any(r.return_logprob for r in self.reqs)

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.reqs)

    @property
    def req_pool_indices(self) -> list[int]:
        """req_to_token rows, in request order."""
        return [int(r.req_pool_idx) for r in self.reqs]  # type: ignore[arg-type]

    @property
    def sampling_params(self) -> list[SamplingParams]:
        """One SamplingParams per request."""
        return [r.sampling_params for r in self.reqs]

    def last_token_ids(self) -> list[int]:
        """Each request's newest token (the decode input)."""
        return [r.last_token_id for r in self.reqs]

    def slots_of(self, i: int) -> torch.Tensor:
        """The slots allocated for request i's new tokens in this forward."""
        start = sum(self.extend_lens[:i])
        return self.out_cache_loc[start : start + self.extend_lens[i]]

    def to_forward_batch(
        self,
        token_to_kv_pool: Any,
        attn_backend: Any,
        *,
        capture_aux_hidden_layers: Optional[list[int]] = None,
    ) -> Any:
        """The plain EXTEND (prefill) or DECODE (one token per request) ForwardBatch of this batch."""
        from sglite.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch

        if self.is_prefill:
            mode = ForwardMode.EXTEND
            items, offset = [], 0
            for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
                items.append((r.req_pool_idx, p, self.input_ids[offset : offset + n]))
                offset += n
            loc = self.out_cache_loc
        else:
            mode = ForwardMode.DECODE
            items = [(r.req_pool_idx, p, [t]) for r, p, t in zip(self.reqs, self.prefix_lens, self.input_ids)]
            # Decode writes one token per request: the first of the slots allocated for it.
            loc = self.out_cache_loc.view(self.batch_size, -1)[:, 0]
        return build_forward_batch(
            mode,
            items,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            out_cache_loc=loc,
            capture_aux_hidden_layers=capture_aux_hidden_layers,
        )
