"""Messages between the serving processes (plain dataclasses, pickled over ZMQ).

Flow (one node): HTTP process (TokenizerManager) --TokenizedGenerateReqInput / AbortReq / control-->
Scheduler rank 0 --BatchTokenIDOut / control replies--> DetokenizerManager --BatchStrOut / forwarded
control replies--> TokenizerManager.

Rules both sides rely on:
- ``rid`` is the one request id through every hop.
- ``BatchTokenIDOut.output_ids[i]`` holds only the tokens *new since the previous message* for that
  rid (several per step under speculation); the detokenizer keeps the running state per rid.
- Every request the scheduler has accepted ends with exactly one entry whose ``finished_reasons[i]``
  is not None (``finish_stop`` / ``finish_length`` / ``finish_abort``), also after an ``AbortReq``.
- Any message the scheduler sends that is not a ``BatchTokenIDOut`` (``FlushCacheReqOutput``,
  ``GetInternalStateReqOutput``, ``HealthCheckOutput``) is forwarded unchanged by the detokenizer to
  the TokenizerManager, so three sockets suffice.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from sglite.srt.sampling.sampling_params import SamplingParams

# A finish reason is a small dict, as SGLang reports it in meta_info["finish_reason"]:
#   {"type": "stop", "matched": <token id or stop string>}, {"type": "length", "length": n},
#   {"type": "abort", "message": "..."}.
FinishReason = dict[str, Any]
# One output position's top-k alternatives: (token ids, their logprobs), best first.
TopLogprobs = tuple[list[int], list[float]]


def finish_stop(matched: Union[int, str, None]) -> FinishReason:
    """EOS, a stop token id, or a stop string ended the request."""
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> FinishReason:
    """max_new_tokens (or the context length) ended the request."""
    return {"type": "length", "length": length}


def finish_abort(message: str = "aborted", status_code: Optional[int] = None) -> FinishReason:
    """The request was aborted (client disconnect, /abort_request, or an error).

    ``status_code`` marks a server-side failure (e.g. a PD KV transfer that failed): a non-streaming
    HTTP request then answers with that status and the message instead of a 200.
    """
    reason: FinishReason = {"type": "abort", "message": message}
    if status_code is not None:
        reason["status_code"] = int(status_code)
    return reason


def new_rid() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# HTTP process -> TokenizerManager (native /generate body, also built by the OpenAI adapters)
# ---------------------------------------------------------------------------------------------
@dataclass
class GenerateReqInput:
    """A /generate request: one prompt or a batch (lists), as text or token ids."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    stream: bool = False
    return_logprob: bool = False
    # SGLang's logprob options: top-k alternatives per output token, where input logprobs start
    # (-1: none), and token texts in the logprob entries.
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    # PD disaggregation (added by the router; identical on the prefill and the decode node).
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None

    @property
    def is_batch(self) -> bool:
        """True when text is a list of strings or input_ids is a list of lists."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        """Number of prompts (1 for a single request)."""
        if not self.is_batch:
            return 1
        return len(self.text) if self.text is not None else len(self.input_ids)  # type: ignore[arg-type]

    def validate(self) -> None:
        """Raise ValueError naming the field when the shape of the request is inconsistent."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' and 'input_ids' must be given")
        if self.text is not None:
            if isinstance(self.text, list):
                if not self.text or not all(isinstance(t, str) for t in self.text):
                    raise ValueError("'text' must be a string or a non-empty list of strings")
            elif not isinstance(self.text, str):
                raise ValueError("'text' must be a string or a list of strings")
        else:
            ids = self.input_ids
            if not isinstance(ids, list) or not ids:
                raise ValueError("'input_ids' must be a non-empty list of token ids (or a list of such lists)")
            rows = ids if isinstance(ids[0], list) else [ids]
            for row in rows:
                if not isinstance(row, list) or not row or not all(_is_int(t) for t in row):
                    raise ValueError("'input_ids' must be a non-empty list of integers (or a list of such lists)")
        n = self.batch_size
        for name in ("sampling_params", "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room"):
            value = getattr(self, name)
            if self.is_batch and isinstance(value, list) and len(value) != n:
                raise ValueError(f"'{name}' has {len(value)} entries for a batch of {n} prompts")
            if not self.is_batch and isinstance(value, list):
                raise ValueError(f"'{name}' must not be a list for a single prompt")
        sp = self.sampling_params
        for d in sp if isinstance(sp, list) else [sp]:
            if d is not None and not isinstance(d, dict):
                raise ValueError("'sampling_params' must be an object (or a list of objects for a batch)")

    def split(self) -> list["GenerateReqInput"]:
        """One single-prompt request per batch entry (rids filled in); validates first."""
        self.validate()
        if not self.is_batch:
            return [dataclasses.replace(self, rid=self.rid or new_rid())]

        def pick(value: Any, i: int) -> Any:
            return value[i] if isinstance(value, list) else value

        out = []
        for i in range(self.batch_size):
            rid = self.rid[i] if isinstance(self.rid, list) else (f"{self.rid}-{i}" if self.rid else new_rid())
            out.append(dataclasses.replace(
                self,
                text=self.text[i] if self.text is not None else None,  # type: ignore[index]
                input_ids=self.input_ids[i] if self.input_ids is not None else None,  # type: ignore[index]
                sampling_params=pick(self.sampling_params, i), rid=rid, bootstrap_host=pick(self.bootstrap_host, i),
                bootstrap_port=pick(self.bootstrap_port, i), bootstrap_room=pick(self.bootstrap_room, i),
            ))
        return out


# ---------------------------------------------------------------------------------------------
# TokenizerManager -> Scheduler
# ---------------------------------------------------------------------------------------------
@dataclass
class TokenizedGenerateReqInput:
    """One validated, tokenized request (never a batch)."""

    rid: str
    input_text: Optional[str]
    input_ids: list[int]
    sampling_params: SamplingParams  # verified; max_new_tokens already clipped to fit the context
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False  # front end only: token texts in the logprob entries
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None


@dataclass
class BatchTokenizedGenerateReqInput:
    """The prompts of one batch request in one message, so the scheduler admits them together (SGLang's name).

    Sent one by one, a batch reaches the scheduler split across its receive polls: the first prompts
    start decoding and the rest trickle in through mixed steps, which is slower than one prefill.
    """

    batch: list[TokenizedGenerateReqInput]


@dataclass
class AbortReq:
    """Abort one request (rid) or every request (abort_all); the scheduler frees its slots."""

    rid: str = ""
    abort_all: bool = False
    message: str = "aborted by the client"


@dataclass
class FlushCacheReq:
    """Drop the radix prefix cache (only when no request is running)."""


@dataclass
class FlushCacheReqOutput:
    """Reply to FlushCacheReq."""

    success: bool
    message: str = ""


@dataclass
class GetInternalStateReq:
    """Ask the scheduler for its live state (for /get_server_info)."""


@dataclass
class GetInternalStateReqOutput:
    """Scheduler state. Keys the server relies on: ``avg_spec_accept_length`` (float or None),
    ``last_gen_throughput`` (tok/s), ``available_kv_slots`` (allocator free slots),
    ``max_total_num_tokens``, ``num_running_reqs``, ``num_waiting_reqs``, ``memory_plan`` (dict of
    the per-rank MemoryPoolConfig). Extra keys are passed through to the client."""

    internal_state: dict[str, Any] = field(default_factory=dict)


@dataclass
class HealthCheckReq:
    """A no-op round trip through the scheduler's event loop."""

    rid: str = field(default_factory=new_rid)


@dataclass
class HealthCheckOutput:
    """Reply to HealthCheckReq (proves the scheduler loop is alive)."""

    rid: str


# Backwards-friendly aliases used by the brief.
GetInternalStateResp = GetInternalStateReqOutput
HealthCheck = HealthCheckReq


# ---------------------------------------------------------------------------------------------
# Scheduler -> DetokenizerManager
# ---------------------------------------------------------------------------------------------
@dataclass
class BatchTokenIDOut:
    """Per-step output for the requests that produced tokens (or finished) in this step.

    All lists are aligned with ``rids``. ``output_ids[i]`` are the tokens new since the previous
    message for that rid. ``completion_tokens`` counts all output tokens so far; ``cached_tokens`` is
    the prompt prefix served from the radix cache; ``spec_verify_ct`` counts target verify forwards
    (0 without speculation). ``skip_special_tokens`` and ``stop_strs`` come from the request's
    SamplingParams so the detokenizer needs no per-request registration.
    """

    rids: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[Optional[FinishReason]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    spec_verify_ct: list[int]
    skip_special_tokens: list[bool]
    stop_strs: list[list[str]]
    output_token_logprobs: Optional[list[Optional[list[float]]]] = None
    # cap-accept: mean drafts verified per verify forward, once a block of the request was trimmed (else None).
    spec_cap_length: Optional[list[Optional[float]]] = None
    # Per request, per new token: (top-k token ids, their logprobs), when the request asked for them.
    output_top_logprobs: Optional[list[Optional[list[TopLogprobs]]]] = None
    # Per request, once after its prefill: (logprobs, top-k) of prompt positions logprob_start_len .. end
    # (None entries where there is none: position 0).
    input_token_logprobs: Optional[list[Optional[tuple[list[Optional[float]], list[Optional[TopLogprobs]]]]]] = None
    # Per request, totals so far (speculative decoding): drafts accepted (without the bonus) and proposed.
    spec_num_correct_drafts: Optional[list[int]] = None
    spec_num_proposed_drafts: Optional[list[int]] = None


# ---------------------------------------------------------------------------------------------
# DetokenizerManager -> TokenizerManager
# ---------------------------------------------------------------------------------------------
@dataclass
class BatchStrOut:
    """Text deltas: ``output_strs[i]`` is the new, final text for rid i (stop strings already trimmed,
    text that could still become a stop string or an incomplete UTF-8 character held back)."""

    rids: list[str]
    output_strs: list[str]
    output_ids: list[list[int]]  # new token ids (trimmed when a stop string ended the request)
    finished_reasons: list[Optional[FinishReason]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    spec_verify_ct: list[int]
    output_token_logprobs: Optional[list[Optional[list[float]]]] = None
    # cap-accept: mean drafts verified per verify forward, once a block of the request was trimmed (else None).
    spec_cap_length: Optional[list[Optional[float]]] = None
    output_top_logprobs: Optional[list[Optional[list[TopLogprobs]]]] = None
    input_token_logprobs: Optional[list[Optional[tuple[list[Optional[float]], list[Optional[TopLogprobs]]]]]] = None
    spec_num_correct_drafts: Optional[list[int]] = None
    spec_num_proposed_drafts: Optional[list[int]] = None


# ---------------------------------------------------------------------------------------------
# Process start-up
# ---------------------------------------------------------------------------------------------
@dataclass
class SchedulerReady:
    """Sent by ``run_scheduler_process`` (rank 0) on its pipe once the model and pools are ready."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    vocab_size: int
    memory_plan: dict[str, Any] = field(default_factory=dict)
    # Widths, KV heads, cell sizes, planned vs allocated pool bytes of the sending rank
    # (BaseModelWorker.rank_report); None from workers that build no pools (test fakes).
    rank_report: Optional[dict[str, Any]] = None
    # Slots a decode step takes per request (1, or the block size B): the front end's admission check
    # (mem_cache.paging.request_kv_slots) prices a request as the scheduler does.
    num_decode_tokens_per_req: int = 1


@dataclass
class SchedulerInitError:
    """Sent on the pipe instead of SchedulerReady when start-up fails (message + traceback)."""

    message: str
    traceback: str = ""


@dataclass
class PortArgs:
    """ZMQ ipc endpoints between the processes of one node, in a private temp dir."""

    scheduler_input_ipc_name: str  # TokenizerManager -> Scheduler rank 0 (PUSH/PULL)
    detokenizer_ipc_name: str  # Scheduler rank 0 -> DetokenizerManager (PUSH/PULL)
    tokenizer_ipc_name: str  # DetokenizerManager -> TokenizerManager (PUSH/PULL)
    dist_init_method: str  # torch.distributed rendezvous for the scheduler ranks
    ipc_dir: str
    dp_rank: int = 0  # replica index of this TP world (DP without DP attention); set per world by the DP launcher
    # Multi-node (--nnodes > 1): node 0 binds every endpoint a front rank uses and fronts connect, so a front on
    # another node needs only node 0's address.
    fronts_connect: bool = False

    @classmethod
    def create(cls, server_args: Any = None) -> "PortArgs":
        """Fresh endpoints in a new temp dir; the rendezvous from --dist-init-addr or a free port."""
        ipc_dir = tempfile.mkdtemp(prefix="sglite-ipc-")
        addr = getattr(server_args, "dist_init_addr", None)
        dist_init_method = f"tcp://{addr}" if addr else f"tcp://127.0.0.1:{free_port()}"
        return cls(
            scheduler_input_ipc_name=f"ipc://{os.path.join(ipc_dir, 'scheduler_input')}",
            detokenizer_ipc_name=f"ipc://{os.path.join(ipc_dir, 'detokenizer')}",
            tokenizer_ipc_name=f"ipc://{os.path.join(ipc_dir, 'tokenizer')}",
            dist_init_method=dist_init_method,
            ipc_dir=ipc_dir,
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
