"""DFlashWorker: DFLASH / DSPARK speculative decoding behind the scheduler's worker seam.

Prefill: the target runs EXTEND with aux capture at the draft's ``target_layer_ids``; the captured
features are written at once as draft context K/V at the target's slots (so any prefix the radix
cache later shares has valid draft KV), and the first token is sampled.

Decode, per request with K/V length P, newest token c and B slots ``S`` the scheduler allocated at
positions ``[P, P+B)``:
1. draft DRAFT_BLOCK forward of ``[c, MASK x (B-1)]`` in ``S`` (the draft pool's entries there are
   temporary), drafts from the target LM head over rows 1..B-1;
2. target TARGET_VERIFY of ``[c, d1 .. d_{B-1}]`` in ``S`` with aux capture;
3. accept (greedy prefix or lossless sampling) ``a`` drafts plus a bonus token;
4. the features of the ``a + 1`` committed inputs ``[c, d1..d_a]`` overwrite the draft pool at
   ``S[:a+1]`` as context K/V. The scheduler keeps K/V length ``P + a + 1`` (fewer if a stop hits)
   and frees the rest of ``S``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglite.srt.layers.logits_processor import LogitsProcessorOutput, token_logprobs
from sglite.srt.layers.sampler import Sampler, mixed_seed
from sglite.srt.managers.base_model_worker import BaseModelWorker
from sglite.srt.managers.schedule_batch import ScheduleBatch
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.srt.speculative.dflash_utils import BlockVerifyResult, greedy_verify, sampling_verify, verify_probs
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)


@dataclass
class DFlashStepStats:
    """What the last decode step did (for tests and logs)."""

    accept_lens: list[int]  # drafts accepted per request (0 .. B-1)
    draft_ids: list[list[int]]  # the B-1 drafts per request


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
    algo = draft.model_config.draft.algorithm if draft.model_config.draft is not None else None
    if algo != server_args.speculative_algorithm:
        raise ValueError(
            f"--speculative-algorithm {server_args.speculative_algorithm} but the draft checkpoint is a {algo} draft "
            f"(architectures {draft.model_config.architectures})"
        )
    return DFlashWorker(
        target, draft, block_size=server_args.speculative_num_draft_tokens, random_seed=server_args.random_seed,
        prefill_only=server_args.disaggregation_mode == "prefill",
    )


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
        block_size: Optional[int] = None,
        random_seed: int = 0,
        context_len: Optional[int] = None,
        prefill_only: bool = False,
    ) -> None:
        self._init_from_target(target_runner)
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
        ckpt_block = int(self.draft_model.block_size)
        self.block_size = int(block_size) if block_size is not None else ckpt_block
        if self.block_size < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 for DFLASH, got {self.block_size}")
        if self.block_size != ckpt_block:
            logger.warning(
                "--speculative-num-draft-tokens %d differs from the draft checkpoint's block_size %d",
                self.block_size,
                ckpt_block,
            )
        self.mask_token_id = int(self.draft_model.mask_token_id)
        self.capture_layers = list(self.draft_model.target_layer_ids)
        self.vocab_size = int(self.target_model.config.vocab_size)
        self.device = torch.device(getattr(target_runner, "device", "cpu"))
        if draft_runner.token_to_kv_pool_allocator is not self.token_to_kv_pool_allocator:
            raise ValueError("the draft runner must share the target's slot allocator (slot i = one token in both pools)")
        if draft_runner.req_to_token_pool is not self.req_to_token_pool:
            raise ValueError("the draft runner must share the target's req_to_token pool (one slot row per request)")
        plan = target_runner.memory_pool_config
        # A decode step writes B slots past the K/V length, so rows need B - 1 columns beyond the context.
        row_cols = int(self.req_to_token_pool.req_to_token.shape[1])
        # PD prefill node: no verify block ever runs, so its plan has no verify columns (and no verify scratch).
        self.prefill_only = bool(prefill_only)
        if self.prefill_only and context_len is None:
            context_len = int(plan.context_len)
        self.context_len = int(context_len) if context_len is not None else row_cols - self.block_size + 1
        if not self.prefill_only and self.context_len + self.block_size - 1 > row_cols:
            raise ValueError(
                f"context length {self.context_len} + block {self.block_size} - 1 exceeds the req_to_token "
                f"rows ({row_cols} columns); lower --context-length"
            )
        self.num_decode_tokens_per_req = self.block_size
        self.sampler = Sampler(seed=random_seed)
        self._verify_generator = torch.Generator(device=self.device).manual_seed(random_seed)
        self.last_step: Optional[DFlashStepStats] = None

    # ------------------------------------------------------------------ seam
    @torch.no_grad()
    def forward_prefill(self, batch: ScheduleBatch) -> list[list[int]]:
        """Target EXTEND with aux capture, draft context KV at the target's slots, one sampled token each."""
        fb = batch.to_forward_batch(
            self.target_runner.token_to_kv_pool,
            self.target_runner.attn_backend,
            capture_aux_hidden_layers=self.capture_layers,
        )
        self._draft_head_idle()  # DP attention: decode steps elsewhere start with a draft-head exchange
        out = self.target_runner.forward(fb)
        self._write_context(out, fb.positions, fb.out_cache_loc)
        info = self._sampling_info(batch)
        next_ids = self.target_runner.sample(out.next_token_logits, info)
        if batch.return_logprob:
            batch.next_token_logprobs = [[float(x)] for x in token_logprobs(out.next_token_logits, next_ids).tolist()]
        return [[int(t)] for t in next_ids.tolist()]

    @torch.no_grad()
    def forward_decode(self, batch: ScheduleBatch) -> list[list[int]]:
        """One draft block + one target verify per request; 1..B new tokens each."""
        if self.prefill_only:
            raise RuntimeError("a PD prefill node (--disaggregation-mode prefill) never decodes; the decode node does")
        bs, block = batch.batch_size, self.block_size
        if any(n != block for n in batch.extend_lens) or batch.out_cache_loc.numel() != bs * block:
            raise ValueError(f"DFLASH decode needs {block} slots per request, the batch has {batch.extend_lens}")
        rows = batch.req_pool_indices
        anchors = list(batch.input_ids)
        slots = batch.out_cache_loc.to(self.device, torch.int64)

        # 1. Draft block: [c, MASK x (B-1)] non-causal over context KV; the block K/V are temporary.
        draft_items = [(r, p, [c] + [self.mask_token_id] * (block - 1)) for r, p, c in zip(rows, batch.prefix_lens, anchors)]
        draft_fb = self._forward_batch(ForwardMode.DRAFT_BLOCK, draft_items, self.draft_runner, slots)
        draft_ids = self.draft_model.propose_drafts(self.draft_runner.forward(draft_fb), draft_fb, block)  # [bs, B-1]

        # 2. Target verify of [c, d1 .. d_{B-1}] in the same slots, capturing features.
        block_ids = torch.cat([torch.tensor(anchors, dtype=torch.int64, device=self.device)[:, None], draft_ids], dim=1)
        verify_items = [(r, p, ids) for r, p, ids in zip(rows, batch.prefix_lens, block_ids.tolist())]
        verify_fb = self._forward_batch(
            ForwardMode.TARGET_VERIFY, verify_items, self.target_runner, slots, capture=self.capture_layers
        )
        verify_out = self.target_runner.forward(verify_fb)

        # 3. Accept.
        result = self._verify(batch, block_ids, verify_out.next_token_logits.reshape(bs, block, -1))

        # 4. Committed inputs [c, d1..d_a] become draft context K/V (radix-safe before the scheduler caches them).
        keep_flat = (torch.arange(block, device=self.device)[None, :] <= result.accept_lens[:, None]).reshape(-1)
        self._write_context(verify_out, verify_fb.positions[keep_flat], slots[keep_flat], row_mask=keep_flat)

        self.last_step = DFlashStepStats(accept_lens=result.accept_lens.tolist(), draft_ids=draft_ids.tolist())
        out: list[list[int]] = []
        for i, n in enumerate(result.accept_lens.tolist()):
            out.append(block_ids[i, 1 : 1 + n].tolist() + [int(result.bonus_ids[i])])
        if batch.return_logprob:
            batch.next_token_logprobs = self._returned_token_logprobs(verify_out.next_token_logits, out, bs, block)
        return out

    @torch.no_grad()
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
    def _returned_token_logprobs(
        verify_logits: torch.Tensor, returned: list[list[int]], bs: int, block: int
    ) -> list[list[float]]:
        """Per request, log p of each returned token under the target's verify row that predicted it.

        Returned token j (accepted drafts, then the bonus) is scored by block row j, the target's
        distribution given the block's first j inputs.
        """
        ids = torch.zeros(bs, block, dtype=torch.int64)
        for i, toks in enumerate(returned):
            ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        lps = token_logprobs(verify_logits.reshape(bs, block, -1), ids).tolist()
        return [row[: len(toks)] for row, toks in zip(lps, returned)]

    def _sampling_info(self, batch: ScheduleBatch) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_sampling_params(
            batch.sampling_params,
            self.vocab_size,
            device=self.device,
            seed_offsets=[len(r.output_ids) for r in batch.reqs],
        )

    def _verify(self, batch: ScheduleBatch, block_ids: torch.Tensor, logits: torch.Tensor) -> BlockVerifyResult:
        """Greedy rows: longest matching prefix + argmax bonus; sampled rows: lossless rejection sampling."""
        result = greedy_verify(block_ids, logits.argmax(dim=-1))
        params = batch.sampling_params
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled:
            return result
        bs, block = block_ids.shape
        info = self._sampling_info(batch).repeat_interleave(block)
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
