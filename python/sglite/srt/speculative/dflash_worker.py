"""DFlashWorker: DFLASH / DSPARK speculative decoding behind the scheduler's worker seam.

Prefill: the target runs EXTEND with aux capture at the draft's ``target_layer_ids``; the captured
features are written at once as draft context K/V at the target's slots (so any prefix the radix
cache later shares has valid draft KV), and the first token is sampled.

Decode, per request with K/V length P, newest token c, n drafts per block (DFLASH: B-1; DSPARK
with ``sample_from_anchor``: B; resolved once in the spec config) and W = n + 1 slots ``S`` the
scheduler allocated at positions ``[P, P+W)``:
1. draft DRAFT_BLOCK forward of ``[c, MASK x (B-1)]`` in ``S[:B]`` (the draft pool's entries there are
   temporary), n drafts from the target LM head (DSPARK: plus the Markov bias, left to right);
2. target TARGET_VERIFY of ``[c, d1 .. d_n]`` in ``S`` with aux capture (``cap-accept``: cut to the
   batch's longest prefix the confidence head still expects accepted, see ``_cap_width``);
3. accept (greedy prefix or lossless sampling) ``a`` drafts plus a bonus token;
4. the features of the ``a + 1`` committed inputs ``[c, d1..d_a]`` overwrite the draft pool at
   ``S[:a+1]`` as context K/V. The scheduler keeps K/V length ``P + a + 1`` (fewer if a stop hits)
   and frees the rest of ``S``.

With ``--speculative-disable-by-batch-size N`` a decode step of N or more requests skips the draft: the
scheduler allocates one slot per request for it (``decode_width`` decides, once per step, before the
allocation), the target decodes ``c`` alone there (capturing its features) and returns one token, as a
step that accepted no draft would. The features' draft context K/V is deferred: draft-free steps only copy their
feature rows into the draft's deferred context buffer, and one batched ``write_context_kv`` catches the
draft pool up (one GEMM of many rows instead of one per step: the per-step write was ~2.5% of a draft-free
step of the default pair on CPU). The buffer is allocated with the draft's pools and priced by the memory
plan (``draft_deferred_context``); it never grows. The catch-up (``flush_deferred_kv``) runs before a
drafted step (the block reads the context), before a step whose rows would not fit the buffer, once the
buffer is full, and whenever the scheduler is about to release or retract a request (its slots may then be
cached for a shared prefix, freed and handed to a new prompt, or filled by a PD transfer). A step with more
rows than the whole buffer writes its own at once. So the waiting rows always belong to slots that running
requests hold, and nothing else reads or writes those slots' draft K/V in the meantime.
With ``--speculative-adaptive`` the same draft-free step is chosen by a measured cost model instead
(``speculative/adaptive.py``: per batch-size bucket, drafted vs plain tokens per second); the batch-size
cap, when set, still wins. The cost model probes a draft-free bucket with a *shadow* step: W slots a request as a
drafted step, the draft block in them, then the target decodes ``c`` alone in the first slot (a draft-free step,
its features deferred; the other slots are freed as after a block that accepted nothing). Its drafts wait in
``ShadowProbe`` until the request's next tokens are out, then ``shadow_committed_tokens`` scores them: the accept
length a verify would have found, for the price of the draft block rather than a verify.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglite.srt.layers.logits_processor import LogitsProcessorOutput, logprobs_with_top
from sglite.srt.layers.sampler import Sampler, mixed_seed
from sglite.srt.managers.base_model_worker import BaseModelWorker
from sglite.srt.managers.schedule_batch import ScheduleBatch
from sglite.srt.mem_cache.memory_pool import DeferredContextRows
from sglite.srt.mem_cache.pool_plan import MemoryPlanError
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglite.srt.speculative.adaptive import AdaptiveSpeculation, StepKind
from sglite.srt.speculative.dflash_utils import (
    BlockVerifyResult,
    committed_tokens,
    greedy_verify,
    sampling_verify,
    verify_probs,
)
from sglite.srt.speculative.shadow_probe import ShadowProbe
from sglite.srt.speculative.step_calibration import calibrate_step_costs, calibration_batch_sizes
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)


# SGLang's ragged-verify modes (SGLANG_RAGGED_VERIFY_MODE): ``static`` verifies every draft;
# ``cap-accept`` cuts the verified block where the confidence head's predicted acceptance drops below
# the threshold. (SGLang's ``compact`` packs per-request windows; sglite's verify forward is uniform.)
RAGGED_VERIFY_MODES = ("static", "cap-accept")

@dataclass
class DFlashStepStats:
    """What the last decode step did (for tests, logs and meta_info)."""

    accept_lens: list[int]  # drafts accepted per request (0 .. n)
    draft_ids: list[list[int]]  # the n drafts per request
    verified_drafts: int = 0  # drafts the target verified per request this step (n, or fewer when capped)


def create_dflash_worker(
    server_args: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
    dist_init_method: Optional[str] = None,
    dp_rank: int = 0,
) -> "DFlashWorker":
    """Build the target runner, the draft runner (sharing its allocator and req->token table) and the worker."""
    from sglite.srt.model_executor.model_runner import ModelRunner

    if not SpeculativeAlgorithm.from_string(server_args.speculative_algorithm).is_dflash_family():
        raise ValueError(
            f"create_dflash_worker needs --speculative-algorithm DFLASH or DSPARK, got {server_args.speculative_algorithm!r}"
        )
    target = ModelRunner(
        server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
    )
    draft = ModelRunner(server_args, is_draft=True, target_runner=target)
    # The target's resolver already checked that the draft checkpoint is of --speculative-algorithm.
    adaptive = None
    if server_args.speculative_adaptive:
        adaptive = AdaptiveSpeculation(max_tokens_per_step=int(target.spec_aux_config.num_verify_tokens))
    worker = DFlashWorker(
        target, draft, random_seed=server_args.random_seed, prefill_only=server_args.disaggregation_mode == "prefill",
        ragged_verify_mode=server_args.ragged_verify_mode, cap_threshold=server_args.ragged_verify_cap_threshold,
        disable_by_batch_size=server_args.speculative_disable_by_batch_size, adaptive=adaptive,
    )
    if adaptive is not None and not worker.prefill_only:
        worker.calibrate_adaptive()
    return worker


class DFlashWorker(BaseModelWorker):
    """Runs target + block-diffusion draft; implements ``forward_prefill`` / ``forward_decode``."""

    is_speculative = True
    # Every returned token has the target's own logits row (the verify forward scores the whole
    # block), so its logprob is exact, not the draft's.
    supports_logprobs = True

    def __init__(
        self,
        target_runner: Any,
        draft_runner: Any,
        *,
        random_seed: int = 0,
        prefill_only: bool = False,
        ragged_verify_mode: str = "static",
        cap_threshold: float = 0.5,
        disable_by_batch_size: Optional[int] = None,
        adaptive: Optional[AdaptiveSpeculation] = None,
    ) -> None:
        self._init_from_target(target_runner)
        # Decode steps of at least this many requests run the target alone (None: always draft).
        self.disable_by_batch_size = disable_by_batch_size
        # --speculative-adaptive: the measured cost model that picks drafted or draft-free steps (None: always draft).
        self.adaptive = adaptive
        self.draft_runner = draft_runner
        self.target_model = target_runner.model
        self.draft_model = draft_runner.model
        if not hasattr(self.draft_model, "write_context_kv"):
            raise TypeError(
                f"draft model {type(self.draft_model).__name__} is not a DFLASH/DSPARK draft; "
                "check --speculative-draft-model-path and --speculative-algorithm"
            )
        self.draft_model.attach_target_head(
            self.target_model.get_embed_tokens(), self.target_model.get_lm_head(), self.target_model.logits_processor
        )
        # B and the drafts per verify are resolved once, into the spec config (resolve_block_geometry).
        aux = target_runner.spec_aux_config
        self.block_size = int(aux.draft_block_size)
        # Drafts one verify proposes: B for DSPARK with sample_from_anchor, B-1 for DFLASH.
        self.num_proposed_drafts = int(aux.num_proposed_drafts)
        trained = int(self.draft_model.block_size)
        if self.block_size > trained:  # slots the draft never learned to fill
            logger.warning("draft block size %d exceeds the draft checkpoint's block_size %d", self.block_size, trained)
        elif self.block_size < trained:  # its first slots, as trained: a narrower verify (the bundled draft on CPU)
            logger.info("draft block size %d, narrower than the draft checkpoint's block_size %d", self.block_size, trained)
        if ragged_verify_mode not in RAGGED_VERIFY_MODES:
            raise ValueError(f"ragged verify mode {ragged_verify_mode!r} is not one of {list(RAGGED_VERIFY_MODES)}")
        if ragged_verify_mode == "cap-accept" and getattr(self.draft_model, "confidence_head", None) is None:
            raise ValueError(
                "SGLANG_RAGGED_VERIFY_MODE=cap-accept needs a DSPARK draft with a confidence head "
                "(enable_confidence_head); use static"
            )
        self.ragged_verify_mode = ragged_verify_mode
        self.cap_threshold = float(cap_threshold)
        self.mask_token_id = int(self.draft_model.mask_token_id)
        self.capture_layers = list(self.draft_model.target_layer_ids)
        self.vocab_size = int(self.target_model.config.vocab_size)
        self.device = torch.device(getattr(target_runner, "device", "cpu"))
        if draft_runner.token_to_kv_pool_allocator is not self.token_to_kv_pool_allocator:
            raise ValueError("the draft runner must share the target's slot allocator (slot i = one token in both pools)")
        if draft_runner.req_to_token_pool is not self.req_to_token_pool:
            raise ValueError("the draft runner must share the target's req_to_token pool (one slot row per request)")
        # context_len is the plan's (_init_from_target). A decode step writes the verify width W past the K/V
        # length, inside the W - 1 extra req_to_token columns the plan reserved; block rows past the limit
        # are scratch (never committed), so the limit is not widened by W.
        self.prefill_only = bool(prefill_only)  # PD prefill node: no verify block, no verify columns
        self.num_decode_tokens_per_req = int(aux.num_verify_tokens)
        width = self.num_decode_tokens_per_req
        row_cols = int(self.req_to_token_pool.req_to_token.shape[1])
        if not self.prefill_only and self.context_len + width - 1 > row_cols:
            raise ValueError(
                f"context length {self.context_len} + verify width {width} - 1 exceeds the req_to_token "
                f"rows ({row_cols} columns); the memory plan must reserve the verify block"
            )
        self.sampler = Sampler(seed=random_seed)
        self._verify_generator = torch.Generator(device=self.device).manual_seed(random_seed)
        self.last_step: Optional[DFlashStepStats] = None
        # Draft-free steps' (features, positions, slots) whose draft context K/V is not written yet (module
        # docstring): the planned buffer the draft's pools were built with.
        self.deferred_context = self._planned_deferred_context(draft_runner.kv_pools.deferred_context)
        # The cost model's plan for the next decode step, when it is a shadow step: the batch size it was planned at.
        self._shadow_batch_size: Optional[int] = None
        self.shadow_probes: list[ShadowProbe] = []  # shadow steps whose drafts are not scored yet

    # ------------------------------------------------------------------ seam
    # inference_mode, as TpModelWorker: no version counters or view tracking on the ~1100 small ops of a
    # step (a draft-free step of the default pair on CPU: ~3% of its time at batch 1). Only token ids,
    # floats and writes into pools allocated outside leave a step.
    @torch.inference_mode()
    def forward_prefill(self, batch: ScheduleBatch) -> list[list[int]]:
        """Target EXTEND with aux capture, draft context KV at the target's slots, one sampled token each.

        Running requests may decode inside it (mixed chunk, one token each, see ``mixes_decode``): for them
        it is a draft-free step whose context K/V is written at once.
        """
        fb = batch.to_forward_batch(
            self.target_runner.token_to_kv_pool,
            self.target_runner.attn_backend,
            capture_aux_hidden_layers=self.capture_layers,
        )
        fb.return_extend_logits = batch.needs_extend_logits
        self._draft_head_idle()  # DP attention: decode steps elsewhere start with a draft-head exchange
        out = self.target_runner.forward(fb)
        if out.extend_logits is not None:
            batch.record_input_logprobs(out.extend_logits)
        self._write_context(out, fb.positions, fb.out_cache_loc)
        info = self._sampling_info(batch)
        next_ids = self.target_runner.sample(out.next_token_logits, info)
        if batch.return_logprob:
            batch.record_sampled_logprobs(out.next_token_logits, next_ids)
        return [[int(t)] for t in next_ids.tolist()]

    def _capped(self, batch_size: int) -> bool:
        """Whether --speculative-disable-by-batch-size takes this step off the draft (it outranks the cost model)."""
        return self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size

    def decode_width(self, batch_size: int) -> int:
        """W slots a request when the next step drafts, 1 when it skips the draft (the one decision per step).

        A draft-free step given W slots would keep one and free the rest, so the request's K/V would land
        every W-th slot: measured 5.5% slower decode steps at batch 8 on the default pair (compiled, CPU),
        against 1% for the capture itself.
        """
        if self.prefill_only:
            return self.num_decode_tokens_per_req
        self._shadow_batch_size = None
        if self._capped(batch_size):
            return 1
        if self.adaptive is None:
            return self.num_decode_tokens_per_req
        self._score_shadow_probes()
        kind = self.adaptive.next_step(batch_size)
        if kind is StepKind.SHADOW:
            self._shadow_batch_size = batch_size
        return 1 if kind is StepKind.PLAIN else self.num_decode_tokens_per_req

    @torch.inference_mode()
    def forward_decode(self, batch: ScheduleBatch) -> list[list[int]]:
        """A drafted step (W slots a request: draft block + verify, 1..n+1 tokens each) or a draft-free one (1 slot).

        The batch's width is ``decode_width``'s decision for this step.
        """
        if self.prefill_only:
            raise RuntimeError("a PD prefill node (--disaggregation-mode prefill) never decodes; the decode node does")
        bs, width = batch.batch_size, batch.extend_lens[0] if batch.extend_lens else 0
        if (
            width not in (1, self.num_decode_tokens_per_req)
            or any(n != width for n in batch.extend_lens)
            or batch.out_cache_loc.numel() != bs * width
        ):
            raise ValueError(
                f"DFLASH decode needs {self.num_decode_tokens_per_req} slots per request (1 without the draft), "
                f"the batch has {batch.extend_lens}"
            )
        slots = self._slots(batch)
        drafted = width > 1
        if drafted:  # outside the timed step: the catch-up is the deferred cost of earlier draft-free steps
            self.flush_deferred_kv()
        shadow_of, self._shadow_batch_size = self._shadow_batch_size, None  # set by decode_width for this step only
        if self.adaptive is None or self._capped(bs):
            return self._decode(batch, slots, drafted)
        # The whole step, host to host: every path ends in a .tolist() that waits for the device.
        start = time.perf_counter()
        if drafted and shadow_of is not None:
            out = self._decode_shadow(batch, slots, shadow_of)
            self.adaptive.record_shadow(shadow_of, max(time.perf_counter() - start, 1e-9))
            return out
        out = self._decode(batch, slots, drafted)
        seconds = time.perf_counter() - start
        tokens_per_req = 1.0 + sum(self.last_step.accept_lens) / bs if drafted else 1.0
        self.adaptive.record(bs, drafted, max(seconds, 1e-9), tokens_per_req)
        return out

    def _decode(self, batch: ScheduleBatch, slots: torch.Tensor, drafted: bool) -> list[list[int]]:
        """A drafted step in the [bs, W] slots, or a draft-free one in each request's first."""
        return self._decode_with_draft(batch, slots) if drafted else self._decode_without_draft(batch, slots[:, 0])

    @torch.inference_mode()
    def calibrate_adaptive(self) -> None:
        """Start the cost model warm: both kinds of decode step timed per batch-size bucket on dummy batches
        (``step_calibration``); their K/V lands in the padding slot and their deferred rows are written there."""
        if self.adaptive is None:
            raise RuntimeError("calibrate_adaptive needs --speculative-adaptive (the cost model it starts)")
        sizes = calibration_batch_sizes(self.max_running_requests, self.adaptive.config.calibrate_max_batch_size)
        calibrate_step_costs(
            self.adaptive, self, lambda batch, drafted: self._decode(batch, self._slots(batch), drafted),
            self.flush_deferred_kv, sizes,
        )
        self.last_step = None

    def _slots(self, batch: ScheduleBatch) -> torch.Tensor:
        """The batch's slots as [bs, slots a request] on this device."""
        return batch.out_cache_loc.to(self.device, torch.int64).reshape(batch.batch_size, -1)

    def mixes_decode(self, num_running: int) -> bool:
        """Whether running requests may decode inside a prefill: only while their decode steps skip the draft.

        A mixed forward gives each of them one token, a draft-free step; while drafting pays, the scheduler
        keeps them out so their next decode step drafts.
        """
        if self.prefill_only or num_running < 1:
            return False
        if self._capped(num_running):
            return True
        return self.adaptive is not None and self.adaptive.drafting_off(num_running)

    @torch.inference_mode()
    def flush_deferred_kv(self) -> None:
        """Write the deferred draft-free steps' features as draft context K/V, in one batched pass."""
        buf = self.deferred_context
        if buf is None or buf.size == 0:
            return
        self.draft_model.write_context_kv(*buf.pending(), self.draft_runner.token_to_kv_pool)
        buf.clear()

    def _draft_block(self, batch: ScheduleBatch, slots: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The draft block [c, MASK x (B-1)], non-causal over context K/V, in the first B slots (temporary K/V):
        the n drafts per request [bs, n] and how many of them a verify scores (n, or the confidence cap)."""
        block = self.block_size
        draft_items = [
            (r, p, [c] + [self.mask_token_id] * (block - 1))
            for r, p, c in zip(batch.req_pool_indices, batch.prefix_lens, batch.input_ids)
        ]
        draft_fb = self._forward_batch(
            ForwardMode.DRAFT_BLOCK, draft_items, self.draft_runner, slots[:, :block].reshape(-1)
        )
        self._clamp_block_positions(draft_fb)
        proposal = self.draft_model.propose_drafts(self.draft_runner.forward(draft_fb), draft_fb, block)
        verified = self._cap_width(proposal.confidence_logits) if self.ragged_verify_mode == "cap-accept" else proposal.ids.shape[1]
        return proposal.ids, verified

    def _decode_with_draft(self, batch: ScheduleBatch, slots: torch.Tensor) -> list[list[int]]:
        """Draft block, target verify, accept, committed features as draft context K/V; 1..n+1 tokens each."""
        bs = batch.batch_size
        rows = batch.req_pool_indices
        anchors = list(batch.input_ids)

        # 1. Draft block.
        draft_ids, verified = self._draft_block(batch, slots)

        # 2. Target verify of [c, d1 .. d_m] (m = n, or the confidence cap) in the same slots, capturing features.
        w = verified + 1
        block_ids = torch.cat(
            [torch.tensor(anchors, dtype=torch.int64, device=self.device)[:, None], draft_ids[:, :verified]], dim=1
        )
        verify_slots = slots[:, :w].reshape(-1)
        verify_items = [(r, p, ids) for r, p, ids in zip(rows, batch.prefix_lens, block_ids.tolist())]
        verify_fb = self._forward_batch(
            ForwardMode.TARGET_VERIFY, verify_items, self.target_runner, verify_slots, capture=self.capture_layers
        )
        self._clamp_block_positions(verify_fb)
        verify_out = self.target_runner.forward(verify_fb)

        # 3. Accept.
        result = self._verify(batch, block_ids, verify_out.next_token_logits.reshape(bs, w, -1))

        # 4. Committed inputs [c, d1..d_a] become draft context K/V (radix-safe before the scheduler caches them).
        keep_flat = (torch.arange(w, device=self.device)[None, :] <= result.accept_lens[:, None]).reshape(-1)
        self._write_context(verify_out, verify_fb.positions[keep_flat], verify_slots[keep_flat], row_mask=keep_flat)

        self.last_step = DFlashStepStats(
            accept_lens=result.accept_lens.tolist(), draft_ids=draft_ids.tolist(), verified_drafts=verified
        )
        out = committed_tokens(block_ids, result)
        if batch.return_logprob:
            self._returned_token_logprobs(batch, verify_out.next_token_logits, out, w)
        return out

    def _decode_without_draft(
        self, batch: ScheduleBatch, slots: torch.Tensor, draft_head_ran: bool = False
    ) -> list[list[int]]:
        """Target-only decode of each newest token in its first block slot; its features wait for draft context K/V."""
        items = [(r, p, [c]) for r, p, c in zip(batch.req_pool_indices, batch.prefix_lens, batch.input_ids)]
        fb = self._forward_batch(ForwardMode.DECODE, items, self.target_runner, slots, capture=self.capture_layers)
        if not draft_head_ran:  # a shadow step's draft block already made this step's draft-head exchange
            self._draft_head_idle()  # DP attention: peers that draft this step exchange draft-head rows first
        out = self.target_runner.forward(fb)
        self._defer_context(out, fb.positions, slots)
        next_ids = self.target_runner.sample(out.next_token_logits, self._sampling_info(batch))
        if batch.return_logprob:
            batch.record_sampled_logprobs(out.next_token_logits, next_ids)
        bs = batch.batch_size
        self.last_step = DFlashStepStats(accept_lens=[0] * bs, draft_ids=[[] for _ in range(bs)], verified_drafts=0)
        return [[int(t)] for t in next_ids.tolist()]

    def _decode_shadow(self, batch: ScheduleBatch, slots: torch.Tensor, planned_batch_size: int) -> list[list[int]]:
        """A probe of a draft-free bucket: the draft block in the W slots, then a draft-free step in the first; one
        token each, the drafts kept to be scored against the tokens that follow (``_score_shadow_probes``)."""
        draft_ids, verified = self._draft_block(batch, slots)
        out = self._decode_without_draft(batch, slots[:, 0], draft_head_ran=True)
        self.shadow_probes.append(ShadowProbe(
            planned_batch_size, list(batch.reqs), [len(r.output_ids) for r in batch.reqs],
            draft_ids[:, :verified].tolist(),
        ))
        return out

    def _score_shadow_probes(self) -> None:
        """Tell the cost model what each shadow step's drafts would have committed, once its requests' tokens are out."""
        waiting = []
        for probe in self.shadow_probes:
            scores = probe.sample()
            if scores is None:
                waiting.append(probe)
            elif scores:
                self.adaptive.record_shadow_accept(probe.batch_size, sum(scores) / len(scores), len(scores))
        self.shadow_probes = waiting

    def _cap_width(self, confidence_logits: torch.Tensor) -> int:
        """Drafts to verify under cap-accept: the longest prefix whose predicted survival stays >= the threshold.

        Slot k's confidence is the head's probability that draft k is accepted given the drafts before
        it, so the prefix of length m survives with prod_{k<m} sigmoid(logit_k). The verify forward is
        one uniform block, so the batch verifies the largest such m over its requests (at least one
        draft); every request may still accept up to m drafts, so output stays exactly the target's.
        """
        survival = torch.sigmoid(confidence_logits.float()).cumprod(dim=1)  # [bs, n]
        keep = (survival >= self.cap_threshold).sum(dim=1)
        return max(1, int(keep.max()))

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """DP attention: the collectives of one step with no tokens (draft head, then the target forward)."""
        self._draft_head_idle()
        self.target_runner.forward_idle(self.capture_layers)

    # ------------------------------------------------------------------ helpers
    def _draft_head_idle(self) -> None:
        """Zero draft rows through the draft's head (the target LM head, sharded over all of TP).

        Under DP attention every step of every group runs the same cross-group exchanges in the same
        order: [draft head] then [target forward]. A decode step's draft block reaches the head once;
        prefill and idle steps make the same call with no rows. Without DP attention it does nothing.
        """
        if self.dp_peer_group is None:
            return
        hidden = self.draft_model.config.hidden_size
        self.draft_model.compute_logits(torch.zeros(0, hidden, dtype=self.draft_runner.dtype, device=self.device))

    def _forward_batch(
        self, mode: ForwardMode, items: list, runner: Any, slots: torch.Tensor, capture: Optional[list[int]] = None
    ) -> ForwardBatch:
        # Both runners hold the shared req_to_token pool, so the runner's own batch builder fits either.
        return runner.build_forward_batch(mode, items, out_cache_loc=slots, capture_aux_hidden_layers=capture)

    def _clamp_block_positions(self, fb: ForwardBatch) -> None:
        """Keep block rows inside the context: rope has no angles past it (an index error, or a device assert).

        A request's committed tokens all sit below ``context_len``; a block row at or past it can only
        predict a token beyond the limit, which the scheduler drops. Causal verify rows below the limit
        never see those rows; the non-causal draft may, which changes drafts only, never what is accepted.
        """
        fb.positions.clamp_(max=self.context_len - 1)

    def _defer_context(self, out: LogitsProcessorOutput, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep a draft-free step's feature rows for the next catch-up (``flush_deferred_kv``)."""
        if out.aux_hidden_states is None:
            raise RuntimeError("the target returned no aux hidden states; it must capture the draft's target layers")
        buf = self.deferred_context
        if buf is None:
            raise RuntimeError("a draft-free step without a deferred context buffer; the memory plan must price it")
        rows = int(slots.numel())
        if rows > buf.free_rows:  # the buffer never grows (its bytes are planned): make room first
            self.flush_deferred_kv()
        if rows > buf.capacity:  # wider than the whole buffer: already one large GEMM, nothing to batch
            self._write_context(out, positions, slots)
            return
        buf.append(out.aux_hidden_states, positions, slots)  # a copy: a replayed CUDA graph reuses its outputs
        if buf.free_rows == 0:
            self.flush_deferred_kv()

    def _planned_deferred_context(self, buf: Optional[DeferredContextRows]) -> Optional[DeferredContextRows]:
        """The draft pools' deferred context buffer, checked against this worker and the memory plan.

        It exists exactly when decode steps may skip the draft (the plan reads the same flags), holds this
        draft's feature width in the target's dtype, and its bytes are the plan's ``draft_deferred_context``.
        """
        skips = not self.prefill_only and (self.disable_by_batch_size is not None or self.adaptive is not None)
        if skips != (buf is not None):
            raise MemoryPlanError(
                f"decode steps {'may' if skips else 'never'} skip the draft but the memory plan "
                f"{'has no' if buf is None else 'has a'} deferred draft context buffer; the plan and the worker "
                "must read the same --speculative-adaptive / --speculative-disable-by-batch-size"
            )
        if buf is None:
            return None
        width = len(self.capture_layers) * int(self.draft_model.config.hidden_size)
        if (buf.feature_width, buf.dtype) != (width, self.target_runner.dtype):
            raise MemoryPlanError(
                f"the planned deferred context buffer holds {buf.feature_width}-wide {buf.dtype} features; this "
                f"draft captures {width}-wide {self.target_runner.dtype} ones"
            )
        planned = self.target_runner.memory_pool_config.planned_pool_bytes.get("draft_deferred_context")
        if buf.nbytes() != planned:
            raise MemoryPlanError(f"deferred draft context buffer allocated {buf.nbytes()} B, planned {planned} B")
        return buf

    def _write_context(
        self,
        out: LogitsProcessorOutput,
        positions: torch.Tensor,
        slots: torch.Tensor,
        row_mask: Optional[torch.Tensor] = None,
    ) -> None:
        aux = out.aux_hidden_states
        if aux is None:
            raise RuntimeError("the target returned no aux hidden states; it must capture the draft's target layers")
        if row_mask is not None:
            aux = aux[row_mask]
        self.draft_model.write_context_kv(aux, positions, slots, self.draft_runner.token_to_kv_pool)

    @staticmethod
    def _returned_token_logprobs(batch: ScheduleBatch, verify_logits: torch.Tensor, returned: list[list[int]], block: int) -> None:
        """Per request, log p (and the top-k) of each returned token under the target's verify row that predicted it.

        Returned token j (accepted drafts, then the bonus) is scored by block row j, the target's
        distribution given the block's first j inputs.
        """
        bs = len(returned)
        ids = torch.zeros(bs, block, dtype=torch.int64)
        for i, toks in enumerate(returned):
            ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        ks = [r.top_logprobs_num for r in batch.reqs for _ in range(block)]
        chosen, top = logprobs_with_top(verify_logits.reshape(bs * block, -1), ids.reshape(-1), ks)
        batch.next_token_logprobs = [chosen[i * block : i * block + len(t)] for i, t in enumerate(returned)]
        batch.next_token_top_logprobs = [top[i * block : i * block + len(t)] for i, t in enumerate(returned)]

    def _verify(self, batch: ScheduleBatch, block_ids: torch.Tensor, logits: torch.Tensor) -> BlockVerifyResult:
        """Greedy rows: longest matching prefix + argmax bonus; sampled rows: lossless rejection sampling.

        Both judge the drafts by the processed distribution (penalties, bias, min_new_tokens) that plain
        decoding would sample from at each block position: row j's penalty state includes drafts 1..j.
        """
        params = batch.sampling_params
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        bs, block = block_ids.shape
        info = None
        if sampled or any(p.needs_logits_processing for p in params):
            info = self._sampling_info(batch).repeat_interleave(block, block_ids)
            logits = info.process_logits(logits.reshape(bs * block, -1)).reshape(bs, block, -1)
        result = greedy_verify(block_ids, logits.argmax(dim=-1))
        if not sampled:
            return result
        probs = verify_probs(logits.reshape(bs * block, -1), info, self.sampler).reshape(bs, block, -1)
        for i in sampled:
            seed = params[i].seed
            gen = self._verify_generator
            if seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(mixed_seed(seed, len(batch.reqs[i].output_ids)))
            r = sampling_verify(block_ids[i : i + 1], probs[i : i + 1], generator=gen)
            result.accept_lens[i] = r.accept_lens[0]
            result.bonus_ids[i] = r.bonus_ids[0]
        return result
