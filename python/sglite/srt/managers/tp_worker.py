"""TpModelWorker: the non-speculative model worker behind the scheduler's seam (one token per step)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglite.srt.managers.base_model_worker import BaseModelWorker
from sglite.srt.managers.schedule_batch import ScheduleBatch
from sglite.srt.server_args import ServerArgs


class TpModelWorker(BaseModelWorker):
    """Wraps one target ModelRunner: prefill = EXTEND, decode = DECODE, one sampled token per request."""

    is_speculative = False
    num_decode_tokens_per_req = 1
    supports_logprobs = True

    def __init__(self, model_runner: Any) -> None:
        self._init_from_target(model_runner)
        self.vocab_size = int(model_runner.model_config.vocab_size)
        self.device = torch.device(model_runner.device)

    @classmethod
    def create(
        cls,
        server_args: ServerArgs,
        *,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: Optional[str] = None,
        dp_rank: int = 0,
    ) -> "TpModelWorker":
        """Build the target ModelRunner for this rank and wrap it."""
        from sglite.srt.model_executor.model_runner import ModelRunner

        return cls(
            ModelRunner(
                server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
            )
        )

    # inference_mode, not just no_grad: no version counters or view tracking on the forward's tensors
    # (~150 us per decode step of the default model on CPU). Nothing made here is modified in place
    # afterwards: only token ids and logprob floats leave; pools and tables were allocated outside.
    @torch.inference_mode()
    def _forward_and_sample(self, batch: ScheduleBatch) -> list[list[int]]:
        runner = self.target_runner
        fb = batch.to_forward_batch(runner.token_to_kv_pool, runner.attn_backend)
        fb.return_extend_logits = batch.needs_extend_logits
        out = runner.forward(fb)
        if out.extend_logits is not None:
            batch.record_input_logprobs(out.extend_logits)
        logits = out.next_token_logits
        next_ids = runner.sample(logits, self._sampling_info(batch))
        if batch.return_logprob:
            # The model's own distribution (raw logits, before temperature / top-k / top-p), as vLLM reports it.
            batch.record_sampled_logprobs(logits, next_ids)
        return [[int(t)] for t in next_ids.tolist()]

    @torch.inference_mode()  # as _forward_and_sample: every forward of this worker runs in one mode
    def forward_idle(self) -> None:
        """DP attention: take part in the other groups' forward with no tokens of our own."""
        self.target_runner.forward_idle()

    def forward_prefill(self, batch: ScheduleBatch) -> list[list[int]]:
        """EXTEND over each request's new tokens; one sampled token per request."""
        return self._forward_and_sample(batch)

    def forward_decode(self, batch: ScheduleBatch) -> list[list[int]]:
        """DECODE of each request's newest token; one sampled token per request."""
        return self._forward_and_sample(batch)
