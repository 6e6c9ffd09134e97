"""DetokenizerManager: token ids -> text deltas, with stop-string trimming (its own process).

Incremental decoding uses the prefix/read offset scheme: the text of the new tokens is
``decode(ids[prefix:]) - decode(ids[prefix:read])``, so a token that merges with its predecessor
(byte-level BPE, multi-byte UTF-8) is rendered correctly, and text ending in an incomplete character
(U+FFFD) is held back until the next token completes it. Stop strings are searched token by token,
so the request ends at exactly the token that completed a stop string; text that could still turn
into a stop string is held back until it cannot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from sglite.srt.managers.io_struct import (
    BatchStrOut,
    BatchTokenIDOut,
    FinishReason,
    PortArgs,
    finish_abort,
    finish_stop,
)

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeStatus:
    """Running decode state of one request."""

    skip_special_tokens: bool
    stop_strs: list[str]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (before stop trimming)
    prefix_offset: int = 0
    read_offset: int = 0
    sent_len: int = 0  # characters of `text` already sent to the client
    sent_ids: int = 0  # ids already sent
    stopped: Optional[str] = None  # the stop string that ended the request, once seen


@dataclass
class DecodeDelta:
    """What one feed produced for a request."""

    text: str
    ids: list[int]
    stop_matched: Optional[str]  # set when a stop string ended the request in this feed
    num_ids_total: int  # output tokens up to and including the one that completed the stop


class IncrementalDetokenizer:
    """Per-request incremental detokenization and stop-string handling over one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeStatus] = {}

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def feed(
        self,
        rid: str,
        new_ids: list[int],
        finished: bool,
        skip_special_tokens: bool = True,
        stop_strs: Optional[list[str]] = None,
    ) -> DecodeDelta:
        """Add new token ids for rid and return the text that is now final.

        When ``finished`` is True (or a stop string is found) the state of rid is dropped and all
        remaining text is flushed (minus the stop string and anything after it).
        """
        st = self.states.get(rid)
        if st is None:
            st = DecodeStatus(skip_special_tokens=skip_special_tokens, stop_strs=list(stop_strs or []))
            self.states[rid] = st
        for tok in new_ids:
            st.ids.append(tok)
            self._advance(st)
            if st.stop_strs:
                hit = self._find_stop(st)
                if hit is not None:
                    pos, s = hit
                    st.stopped = s
                    st.text = st.text[:pos]
                    break
        done = finished or st.stopped is not None
        if done:
            # Flush the tail (an incomplete character at the very end is rendered as U+FFFD,
            # as transformers' decode does).
            if st.stopped is None and st.read_offset < len(st.ids):
                prefix_text = self._decode(st.ids[st.prefix_offset : st.read_offset], st.skip_special_tokens)
                tail_text = self._decode(st.ids[st.prefix_offset :], st.skip_special_tokens)
                st.text += tail_text[len(prefix_text) :]
            end = len(st.text)
        else:
            end = self._safe_end(st)
        delta_text = st.text[st.sent_len:end] if end > st.sent_len else ""
        st.sent_len = max(st.sent_len, end)
        delta_ids = st.ids[st.sent_ids:]
        st.sent_ids = len(st.ids)
        result = DecodeDelta(text=delta_text, ids=delta_ids, stop_matched=st.stopped, num_ids_total=len(st.ids))
        if done:
            del self.states[rid]
        return result

    def drop(self, rid: str) -> None:
        """Forget rid (its request ended elsewhere)."""
        self.states.pop(rid, None)

    def _advance(self, st: DecodeStatus) -> None:
        prefix_text = self._decode(st.ids[st.prefix_offset : st.read_offset], st.skip_special_tokens)
        new_text = self._decode(st.ids[st.prefix_offset :], st.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            st.text += new_text[len(prefix_text) :]
            st.prefix_offset = st.read_offset
            st.read_offset = len(st.ids)

    def _find_stop(self, st: DecodeStatus) -> Optional[tuple[int, str]]:
        # Only text not yet sent can hold a new match; the earliest match wins.
        best: Optional[tuple[int, str]] = None
        longest = max(len(s) for s in st.stop_strs)
        start = max(0, st.sent_len - longest + 1)
        for s in st.stop_strs:
            pos = st.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _safe_end(self, st: DecodeStatus) -> int:
        """End of the text that can no longer become part of a stop string."""
        end = len(st.text)
        for s in st.stop_strs:
            # Hold back the longest suffix of the text that is a proper prefix of s.
            for k in range(min(len(s) - 1, len(st.text)), 0, -1):
                if st.text.endswith(s[:k]):
                    end = min(end, len(st.text) - k)
                    break
        return max(end, st.sent_len)


class DetokenizerManager:
    """Receives BatchTokenIDOut from the scheduler, sends BatchStrOut to the TokenizerManager."""

    def __init__(self, tokenizer: Any, port_args: PortArgs) -> None:
        import zmq

        self.detok = IncrementalDetokenizer(tokenizer)
        # rids the detokenizer ended on a stop string before the scheduler did: their later outputs
        # are dropped until the scheduler's own final entry arrives.
        self.ended_here: set[str] = set()
        self.context = zmq.Context(2)
        self.recv_from_scheduler = self.context.socket(zmq.PULL)
        self.recv_from_scheduler.bind(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = self.context.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)

    def handle(self, out: BatchTokenIDOut) -> Optional[BatchStrOut]:
        """Turn one scheduler output into text deltas (None when nothing is left to send)."""
        rids, strs, ids, reasons = [], [], [], []
        prompt, completion, cached, verify, cap, logprobs, top_logprobs = [], [], [], [], [], [], []
        for i, rid in enumerate(out.rids):
            sched_reason = out.finished_reasons[i]
            if rid in self.ended_here:
                if sched_reason is not None:
                    self.ended_here.discard(rid)
                continue
            try:
                delta = self.detok.feed(
                    rid, out.output_ids[i], sched_reason is not None, out.skip_special_tokens[i], out.stop_strs[i]
                )
            except Exception as e:  # one request's decode fault ends that request, not this process
                delta, sched_reason = self._fail(rid, sched_reason, e)
            reason: Optional[FinishReason] = sched_reason
            completion_tokens = out.completion_tokens[i]
            if delta.stop_matched is not None:
                reason = finish_stop(delta.stop_matched)
                # Tokens after the one that completed the stop string were never part of the answer.
                extra = completion_tokens - delta.num_ids_total
                completion_tokens = delta.num_ids_total
                if sched_reason is None:
                    self.ended_here.add(rid)
                elif extra < 0:
                    logger.warning("rid %s: scheduler counted fewer tokens than it sent", rid)
            rids.append(rid)
            strs.append(delta.text)
            ids.append(delta.ids)
            reasons.append(reason)
            prompt.append(out.prompt_tokens[i])
            completion.append(completion_tokens)
            cached.append(out.cached_tokens[i])
            verify.append(out.spec_verify_ct[i])
            cap.append(out.spec_cap_length[i] if out.spec_cap_length is not None else None)
            if out.output_token_logprobs is not None:
                lp = out.output_token_logprobs[i]
                logprobs.append(None if lp is None else lp[: len(delta.ids)])
            if out.output_top_logprobs is not None:
                top = out.output_top_logprobs[i]
                top_logprobs.append(None if top is None else top[: len(delta.ids)])
        if not rids:
            return None
        return BatchStrOut(
            rids=rids, output_strs=strs, output_ids=ids, finished_reasons=reasons, prompt_tokens=prompt,
            completion_tokens=completion, cached_tokens=cached, spec_verify_ct=verify, spec_cap_length=cap,
            output_token_logprobs=logprobs if out.output_token_logprobs is not None else None,
            output_top_logprobs=top_logprobs if out.output_top_logprobs is not None else None,
            input_token_logprobs=_kept(out.input_token_logprobs, out.rids, rids),
            spec_num_correct_drafts=_kept(out.spec_num_correct_drafts, out.rids, rids),
            spec_num_proposed_drafts=_kept(out.spec_num_proposed_drafts, out.rids, rids),
        )

    def _fail(self, rid: str, sched_reason: Optional[FinishReason], error: Exception) -> tuple[DecodeDelta, FinishReason]:
        """End rid with an internal-error abort (HTTP 500 for it); the TokenizerManager aborts it in the scheduler."""
        logger.error("request %s: detokenization failed: %s: %s", rid, type(error).__name__, error,
                     exc_info=logger.isEnabledFor(logging.DEBUG))
        self.detok.drop(rid)
        if sched_reason is None:  # the scheduler still runs it: drop its later outputs
            self.ended_here.add(rid)
        reason = finish_abort(f"internal error while detokenizing: {type(error).__name__}: {error}", status_code=500)
        return DecodeDelta(text="", ids=[], stop_matched=None, num_ids_total=0), reason

    def event_loop(self) -> None:
        """Forever: receive, detokenize or forward, send."""
        while True:
            msg = self.recv_from_scheduler.recv_pyobj()
            if isinstance(msg, BatchTokenIDOut):
                result = self.handle(msg)
                if result is not None:
                    self.send_to_tokenizer.send_pyobj(result)
            else:
                # Control replies (flush cache, internal state, health) pass through unchanged.
                self.send_to_tokenizer.send_pyobj(msg)


def _kept(values: Optional[list[Any]], all_rids: list[str], kept_rids: list[str]) -> Optional[list[Any]]:
    """The entries of ``values`` (aligned with ``all_rids``) for the rids that are forwarded."""
    if values is None:
        return None
    by_rid = dict(zip(all_rids, values))
    return [by_rid[r] for r in kept_rids]


def load_tokenizer(path: str) -> Any:
    """The HF tokenizer at path, or converted from a GGUF file's metadata (fast tokenizer; no network)."""
    from transformers import AutoTokenizer

    from sglite.srt.configs.gguf import find_gguf_file, gguf_metadata_dir

    gguf_file = find_gguf_file(path)
    return AutoTokenizer.from_pretrained(gguf_metadata_dir(gguf_file) if gguf_file else path, local_files_only=True)


def run_detokenizer_process(server_args: Any, port_args: PortArgs) -> None:
    """Process entry: load the tokenizer and serve forever; exits with the parent."""
    from sglite.srt.managers.cpu_threads import limit_to_one_thread
    from sglite.srt.managers.subprocess_watchdog import watch_parent

    watch_parent()
    limit_to_one_thread()
    logging.basicConfig(level=getattr(logging, str(server_args.log_level).upper(), logging.INFO))
    tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
    manager = DetokenizerManager(tokenizer, port_args)
    manager.event_loop()
