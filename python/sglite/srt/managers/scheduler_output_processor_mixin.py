"""The scheduler's output processing: apply a forward's tokens, check finish conditions, emit outputs.

A speculative step may return several tokens per request; they are appended one by one until a
finish condition hits, and the rest are dropped (their K/V slots are freed by the caller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from sglite.srt.managers.io_struct import BatchTokenIDOut, finish_length, finish_stop
from sglite.srt.managers.schedule_batch import Req, ScheduleBatch
from sglite.srt.mem_cache.paging import round_up_to_page

if TYPE_CHECKING:
    from sglite.srt.managers.scheduler import Scheduler


class SchedulerOutputProcessorMixin:
    """Turns worker results into request state and ``BatchTokenIDOut`` messages (mixed into Scheduler)."""

    def process_batch_result_prefill(self: "Scheduler", batch: ScheduleBatch, results: list[list[int]]) -> None:
        """Advance each request by its prefilled chunk; a finished prompt takes its first token."""
        if len(results) != batch.batch_size:
            raise RuntimeError(f"worker returned {len(results)} results for {batch.batch_size} requests")
        decoding = {id(r) for r in self.running}  # requests mixed in with one decode token each
        mixed_spec = False
        for i, (req, n, tokens) in enumerate(zip(batch.reqs, batch.extend_lens, results)):
            req.kv_len += n
            if req.kv_len < req.seq_len:
                continue  # an unfinished chunk: its sampled token is meaningless
            if len(tokens) != 1:
                raise RuntimeError(f"prefill must return exactly one token per request, got {len(tokens)}")
            lp = batch.next_token_logprobs[i][0] if req.return_logprob and batch.next_token_logprobs else None
            if self.disagg.hand_off(req, tokens[0], lp):  # PD prefill node: the decode node continues from here
                continue
            try:
                kept = self._append_tokens(req, tokens)
                self._record_logprobs(req, batch, i, kept)
            except Exception as e:  # one request's finish checks (e.g. its stop strings) fail it alone
                if id(req) in decoding:
                    self.running.remove(req)
                self._fail_request(req, e)
                continue
            if id(req) in decoding and self.worker.is_speculative:
                # A speculative worker mixes only while it would skip the draft: a draft-free step of one token.
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += kept
                mixed_spec = True
            if req.finished:
                if id(req) in decoding:
                    self.running.remove(req)
                self._release(req)
            elif id(req) not in decoding:
                self.running.append(req)
        if mixed_spec:
            self.count_spec_step(False)

    def process_batch_result_decode(self: "Scheduler", batch: ScheduleBatch, results: list[list[int]]) -> None:
        """Keep each request's accepted tokens, free the slots of the rest, release finished requests."""
        reqs, t = batch.reqs, batch.extend_lens[0]
        if len(results) != len(reqs):
            raise RuntimeError(f"worker returned {len(results)} results for {len(reqs)} requests")
        unkept: list[torch.Tensor] = []  # slots past what each request kept: freed with one call below
        for i, (req, tokens) in enumerate(zip(reqs, results)):
            if not 1 <= len(tokens) <= t:
                raise RuntimeError(f"decode must return 1..{t} tokens per request, got {len(tokens)}")
            old_kv = req.kv_len
            try:
                kept = self._append_tokens(req, tokens)
                self._record_logprobs(req, batch, i, kept)
            except Exception as e:  # one request's finish checks (e.g. its stop strings) fail it alone
                self._free_positions(req, round_up_to_page(old_kv, self.page_size), old_kv + t)
                self._fail_request(req, e)
                continue
            if self.worker.is_speculative:
                # Count what the request keeps: a stop inside the accepted run discards the rest.
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += kept
                step = self.worker.last_step
                req.spec_verified_drafts += step.verified_drafts
                # 0 verified: a draft-free step (--speculative-disable-by-batch-size), not a capped block.
                req.spec_capped_ct += int(0 < step.verified_drafts < self.worker.num_proposed_drafts)
                req.spec_num_correct_drafts += len(tokens) - 1  # the worker returns accepted drafts + bonus
                req.spec_num_proposed_drafts += self.worker.num_proposed_drafts if step.verified_drafts else 0
                if step.verified_drafts:  # the server's accept length is the draft's: a draft-free step has none
                    self.spec_verify_total += 1
                    self.spec_accepted_total += kept
            req.kv_len = old_kv + kept
            if t > 1:  # one decode slot per request is always kept
                unkept.append(self._position_slots(req, round_up_to_page(req.kv_len, self.page_size), old_kv + t))
            if req.finished:
                self.running.remove(req)
                self._release(req)
        if self.worker.is_speculative:
            self.count_spec_step(bool(self.worker.last_step.verified_drafts))
        if unkept:  # speculative steps: one free per step, not one per request (the allocator sorts once)
            self.allocator.free(torch.cat(unkept))

    # ------------------------------------------------------------------ finish conditions
    def _append_tokens(self: "Scheduler", req: Req, tokens: Sequence[int]) -> int:
        """Append tokens one by one until a finish condition hits; return how many were kept."""
        kept = 0
        for tok in tokens:
            req.output_ids.append(int(tok))
            kept += 1
            self._gen_tokens_window += 1
            self._check_finished(req)
            if req.finished:
                break
        self._touch(req)
        return kept

    def _record_logprobs(self: "Scheduler", req: Req, batch: ScheduleBatch, i: int, kept: int) -> None:
        """Keep the logprobs of the ``kept`` tokens just appended (when the request asked for them)."""
        if not req.return_logprob:
            return
        if batch.next_token_logprobs is None:
            raise RuntimeError(f"{type(self.worker).__name__} returned no logprobs for a return_logprob batch")
        req.output_token_logprobs.extend(batch.next_token_logprobs[i][:kept])
        if req.top_logprobs_num:
            req.output_top_logprobs.extend(batch.next_token_top_logprobs[i][:kept])

    def _check_finished(self: "Scheduler", req: Req) -> None:
        sp = req.sampling_params
        last = req.output_ids[-1]
        if len(req.output_ids) >= sp.max_new_tokens:
            req.finished_reason = finish_length(sp.max_new_tokens)
        elif last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
            req.finished_reason = finish_stop(last)
        elif req.seq_len >= self.context_len:
            req.finished_reason = finish_length(len(req.output_ids))
        elif sp.stop:
            matched = self._match_stop_str(req)
            if matched is not None:
                req.finished_reason = finish_stop(matched)

    def _match_stop_str(self: "Scheduler", req: Req) -> Optional[str]:
        stops = req.sampling_params.stop
        # A stop string of k characters spans at most k tokens (+ a few for byte-level pieces).
        window = max(len(s) for s in stops) + 8
        tail = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        for s in stops:
            if s in tail:
                return s
        return None

    # ------------------------------------------------------------------ outputs
    def _touch(self: "Scheduler", req: Req) -> None:
        """Mark a request as having news for the detokenizer this step."""
        self._touched[req.rid] = req

    @staticmethod
    def _prompt_logprobs_once(reqs: list[Req]) -> Optional[list[Optional[tuple[list, list]]]]:
        """Per request, its prompt logprobs (and top-k) the first time it is reported after prefill, else None."""
        out: list[Optional[tuple[list, list]]] = []
        for r in reqs:
            ready = r.return_logprob and r.logprob_start_len >= 0 and not r.input_logprobs_sent and bool(r.output_ids)
            out.append(r.prompt_logprob_entries() if ready else None)
            r.input_logprobs_sent = r.input_logprobs_sent or ready
        return out if any(x is not None for x in out) else None

    def _collect_outputs(self: "Scheduler") -> list[BatchTokenIDOut]:
        """One BatchTokenIDOut with every finished or streaming request's new tokens (none if idle)."""
        reqs = [r for r in self._touched.values() if r.finished or r.stream]
        self._touched = {rid: r for rid, r in self._touched.items() if not (r.finished or r.stream)}
        self._update_throughput()
        if not reqs:
            return []
        out = BatchTokenIDOut(
            rids=[r.rid for r in reqs],
            output_ids=[r.output_ids[r.sent_len :] for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],
            prompt_tokens=[len(r.origin_input_ids) for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            spec_verify_ct=[r.spec_verify_ct for r in reqs],
            spec_cap_length=[
                r.spec_verified_drafts / r.spec_verify_ct if r.spec_capped_ct else None for r in reqs
            ],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
            stop_strs=[list(r.sampling_params.stop) for r in reqs],
            output_token_logprobs=(
                [r.output_token_logprobs[r.sent_len :] if r.return_logprob else None for r in reqs]
                if any(r.return_logprob for r in reqs)
                else None
            ),
            output_top_logprobs=(
                [r.output_top_logprobs[r.sent_len :] if r.top_logprobs_num else None for r in reqs]
                if any(r.top_logprobs_num for r in reqs)
                else None
            ),
            input_token_logprobs=self._prompt_logprobs_once(reqs),
            spec_num_correct_drafts=[r.spec_num_correct_drafts for r in reqs],
            spec_num_proposed_drafts=[r.spec_num_proposed_drafts for r in reqs],
        )
        for r in reqs:
            r.sent_len = len(r.output_ids)
        return [out]
