"""Start-up timing of a DFLASH/DSPARK worker's decode steps, so --speculative-adaptive's cost model starts warm.

Without it every batch-size bucket a server visits measures itself with drafted steps (on the default pair on CPU a
drafted step at batch 8 costs ~3 plain ones, and a wave's tail falls through buckets 4, 2 and 1, each measuring), the
largest part of the policy's loss at concurrency 8 and 32 in ``simulate_adaptive.py``. The accept length does not
depend on the batch, the step costs do not depend on the traffic: timed once here, a bucket decides
as soon as any drafted step has sampled the accept length, and a bucket whose drafted step costs more plain steps
than a verify can commit tokens never drafts (``AdaptiveSpeculation.calibrate``).

Each bucket is timed at about three quarters of its top batch size (inside the bucket: 1, 2, 3, 6, 12, 24), with
every request on req_to_token row 0 and KV slot 0, the reserved padding, as the compiled decode's warm-up does: the
steps run the worker's own decode paths over ``CALIBRATION_KEYS`` keys of context, and what they write lands in the
padding slot. Only the dummy batch is made up; the forwards, the accept and the context writes are a live step's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from sglite.srt.managers.schedule_batch import Req, ScheduleBatch
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.speculative.adaptive import AdaptiveSpeculation, bucket_of

logger = logging.getLogger(__name__)

CALIBRATION_KEYS = 128  # context a dummy request attends over (a short chat turn): K/V length before the step
CALIBRATION_REPS = 3  # timed steps of each kind per bucket (the median is kept), after one untimed step

# One decode step of the worker over a dummy batch: drafted (draft block + verify) or not (the target alone).
DecodeStep = Callable[[ScheduleBatch, bool], Any]


def calibration_batch_size(bucket: int) -> int:
    """The batch size a bucket is timed at: about three quarters of its top, inside it (1, 2, 3, 6, 12, 24, ...).

    A drafted step's cost in plain steps grows with the batch, so timing the top would overstate the bucket's
    lower half and the bottom would understate its upper half.
    """
    return max(bucket // 2 + 1, (3 * bucket) // 4)


def calibration_batch_sizes(max_running_requests: int, max_batch_size: int) -> list[int]:
    """One batch size per bucket up to ``max_batch_size`` that a server of ``max_running_requests`` can reach."""
    top = min(max_running_requests, max_batch_size)
    if top < 1:
        return []
    return [min(calibration_batch_size(1 << i), top) for i in range(bucket_of(top).bit_length())]


def dummy_decode_batch(worker: Any, batch_size: int, width: int, keys: int) -> ScheduleBatch:
    """A decode batch of ``batch_size`` greedy requests on the padding row and slot, ``keys`` tokens of context each."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    reqs = [
        Req(rid=f"calibration-{i}", origin_input_ids=[0] * keys, sampling_params=params, req_pool_idx=0, kv_len=keys)
        for i in range(batch_size)
    ]
    return ScheduleBatch(
        reqs=reqs,
        is_prefill=False,
        input_ids=[0] * batch_size,
        prefix_lens=[keys] * batch_size,
        extend_lens=[width] * batch_size,
        out_cache_loc=torch.zeros(batch_size * width, dtype=torch.int64, device=worker.device),
        req_to_token_pool=worker.req_to_token_pool,
        token_to_kv_pool_allocator=worker.token_to_kv_pool_allocator,
    )


def _step_seconds(decode: DecodeStep, batch: ScheduleBatch, drafted: bool) -> float:
    """Wall seconds of one step, host to host (its outputs are Python lists, so the device has finished)."""
    start = time.perf_counter()
    decode(batch, drafted)
    return max(time.perf_counter() - start, 1e-9)


def calibrate_step_costs(
    policy: AdaptiveSpeculation,
    worker: Any,
    decode: DecodeStep,
    flush: Callable[[], None],
    batch_sizes: Sequence[int],
    reps: int = CALIBRATION_REPS,
) -> None:
    """Time ``reps`` drafted and draft-free steps at each batch size (one untimed of each first) into ``policy``.

    ``flush`` writes the deferred context before each drafted step, outside its time, as a live drafted step does.
    """
    if reps < 1:
        raise ValueError(f"calibration needs at least one timed step of each kind, got reps={reps}")
    width = int(worker.num_decode_tokens_per_req)
    keys = max(1, min(CALIBRATION_KEYS, int(worker.context_len) - width))
    start = time.perf_counter()
    for bs in batch_sizes:
        drafted_batch, plain_batch = dummy_decode_batch(worker, bs, width, keys), dummy_decode_batch(worker, bs, 1, keys)
        timed: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps + 1):
            for drafted, batch in ((True, drafted_batch), (False, plain_batch)):
                if drafted:
                    flush()
                seconds = _step_seconds(decode, batch, drafted)
                if rep:  # the first of each kind is a new shape's cold step
                    timed[drafted].append(seconds)
        policy.calibrate(bs, timed[True], timed[False])
    flush()
    logger.info(
        "adaptive speculation: %d batch-size buckets calibrated in %.1f s (batch sizes %s, %d keys of context)",
        len(batch_sizes), time.perf_counter() - start, list(batch_sizes), keys,
    )
