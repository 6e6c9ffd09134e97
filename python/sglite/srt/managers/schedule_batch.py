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

from sglite.srt.layers.logits_processor import logprobs_with_top
from sglite.srt.managers.io_struct import FinishReason, TopLogprobs
from sglite.srt.mem_cache.base_prefix_cache import empty_indices
from sglite.srt.sampling.penaltylib import TokenHistory
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
    top_logprobs_num: int = 0  # top-k alternatives per output token (0: none)
    logprob_start_len: int = -1  # first prompt position whose logprob is returned (-1: none)
    # Prompt logprobs by position (position -> (logprob, top-k)), filled by the prefill forwards.
    input_logprobs: dict[int, tuple[float, TopLogprobs]] = field(default_factory=dict)
    input_logprobs_sent: bool = False
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per output token when asked
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[FinishReason] = None
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS ids (min_new_tokens masks them)

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
    spec_num_correct_drafts: int = 0  # drafts the verifies accepted (without the bonus tokens)
    spec_num_proposed_drafts: int = 0  # drafts the verifies judged (the worker says how many per verify)
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
    def input_logprob_start(self) -> Optional[int]:
        """The first prompt position whose logprob is still to be computed (None: nothing to compute)."""
        if not self.return_logprob or not 0 <= self.logprob_start_len < len(self.origin_input_ids):
            return None
        if len(self.input_logprobs) >= len(self.origin_input_ids) - max(1, self.logprob_start_len):
            return None  # computed before (a retracted request prefills again)
        return self.logprob_start_len

    def prompt_logprob_entries(self) -> tuple[list[Optional[float]], list[Optional[TopLogprobs]]]:
        """Logprobs (and top-k) of prompt positions ``logprob_start_len`` .. end; position 0 has none."""
        positions = range(self.logprob_start_len, len(self.origin_input_ids))
        found = [self.input_logprobs.get(p) for p in positions]
        return [None if f is None else f[0] for f in found], [None if f is None else f[1] for f in found]

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
    # Likewise, when a request asked for ``top_logprobs_num`` > 0: per returned token its top-k alternatives.
    next_token_top_logprobs: Optional[list[list[TopLogprobs]]] = None

    @property
    def top_logprobs_num(self) -> int:
        """The largest top-k any request of the batch asked for (0: none)."""
        return max((r.top_logprobs_num for r in self.reqs if r.return_logprob), default=0)

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

    def token_histories(self) -> Optional[list[TokenHistory]]:
        """Each request's prompt, output and EOS ids when any request has penalties (else None: nothing to build)."""
        if not any(r.sampling_params.needs_logits_processing for r in self.reqs):
            return None
        return [TokenHistory(r.origin_input_ids, r.output_ids, r.eos_token_ids) for r in self.reqs]

    @property
    def needs_extend_logits(self) -> bool:
        """A prefill where some request still needs prompt logprobs (the forward returns every row's logits)."""
        return self.is_prefill and any(r.input_logprob_start is not None for r in self.reqs)

    def record_sampled_logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor) -> None:
        """``next_token_logprobs`` / ``next_token_top_logprobs`` of one sampled token per request (logits ``[bs, V]``)."""
        chosen, top = logprobs_with_top(logits, next_ids.reshape(-1), [r.top_logprobs_num for r in self.reqs])
        self.next_token_logprobs = [[x] for x in chosen]
        self.next_token_top_logprobs = [[t] for t in top]

    def record_input_logprobs(self, extend_logits: torch.Tensor) -> None:
        """Store on each request the logprobs of its prompt tokens this prefill scored.

        Row r of request i's chunk (position ``p + r``) predicts position ``p + r + 1``; positions from
        the request's ``logprob_start_len`` up to the end of its prompt are kept.
        """
        rows, ids, ks, where = [], [], [], []
        offset = 0
        for req, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            start = req.input_logprob_start
            if start is not None:
                tokens = req.origin_input_ids
                for r in range(n):
                    pos = p + r + 1
                    if max(start, 1) <= pos < len(tokens):
                        rows.append(offset + r)
                        ids.append(tokens[pos])
                        ks.append(req.top_logprobs_num)
                        where.append((req, pos))
            offset += n
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=extend_logits.device)
        chosen, top = logprobs_with_top(extend_logits[index], torch.tensor(ids, dtype=torch.int64), ks)
        for (req, pos), lp, t in zip(where, chosen, top):
            req.input_logprobs[pos] = (lp, t)

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
