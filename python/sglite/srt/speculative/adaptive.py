"""AdaptiveSpeculation: a measured cost model that turns DFLASH/DSPARK drafting off when it does not pay.

A drafted decode step costs a draft block plus a verify of W tokens per request and commits the accept
length ``L`` (bonus included) tokens per request; a draft-free step costs one target decode and commits
one. Whether ``L / t_draft`` beats ``1 / t_plain`` depends on the draft's quality on the current traffic,
the hardware and the batch size, so it is measured rather than predicted: one estimate of ``L`` (the draft's
quality on the traffic, which does not depend on how many requests share a step) and, per batch-size
bucket (powers of two), EMAs of the wall time of each kind of step.

- ``L`` is noisy (a request's step commits 1 to B tokens; their spread is about their distance from 1) while
  step times are steady, so it gets a slower estimate than the times, counted per request (a batch-8 step
  observes 8 acceptances): a running mean that turns into an EMA once ``accept_window`` requests are in, with
  its per-request variance, so the gain has a standard error. (An EMA of weight 0.25 swung the gain of a 1.16x
  draft by about +-0.25 around a 1.05 threshold, and the policy drafted on 4% of the steps; docs/benchmarks.md,
  "The real default".)

- An unknown bucket measures first: ``warmup_steps`` drafted steps, then as many draft-free ones; each
  EMA starts at the median of its warm-up samples (the first step of a new shape may be cold).
- Then it drafts while ``L / t_draft >= (1 + margin) / t_plain``; the margin keeps a draft that is only
  as fast as plain (more work, same speed) off. The same threshold turns drafting off: a lower one (1.0) was
  tried and dropped, since the timed forwards leave out costs a drafted step has beyond them (prompts that
  cannot ride along in its forward), so a timed gain just above 1 is no gain.
- The path not taken is still probed, one step every ``interval`` steps: while drafting is off, the only
  way to notice that it started to pay (a repetitive reply, a lighter batch) is to draft now and then;
  while it is on, plain timings go stale as contexts grow. A probe that confirms the current choice
  with confidence (the gain ``z`` standard errors away from the threshold that would flip it) doubles the
  interval (bounded by ``max_probe_interval``), so a draft that keeps losing costs ever less; a probe that
  confirms it only within the gain's error keeps the interval (at batch 1, ``uncertain_probe_max_batch``),
  so a marginal draft is sampled until the estimate settles; a probe that flips the choice resets it. While
  drafting is off the interval counts plain-step time, not steps: a drafted probe costs ``t_draft / t_plain``
  plain steps (~3.4 at batch 8 on a CPU, where one such probe per 32 steps cost ~3% of the run), so every
  bucket spends the same small share of its time probing; a bucket that started off like its smaller
  neighbour and has not timed a drafted step yet uses the neighbour's ratio, a lower bound of its own.
- A new bucket skips the measuring when a neighbour already settles it. The gain ``L * t_plain / t_draft``
  does not grow with the batch: ``L`` does not depend on it, and a drafted step's relative cost
  ``t_draft / t_plain`` only grows (its W - 1 extra verify tokens per request ride along on weight reads
  at small batches and cost their full compute at large ones, on CPU already from batch 2). So when the
  nearest decided smaller bucket does not draft, a bigger one starts off; when the nearest decided bigger
  bucket drafts, a smaller one starts on (not when the two neighbours disagree). Such a bucket takes its
  neighbour's probe interval (the neighbour's probes have confirmed the choice that often), measures the
  path it runs, and the other path through its probes only; once both of its EMAs are warm it decides
  from its own timings like any other bucket. Until then the choice lasts only while the neighbour keeps
  it: if the neighbour switches (a reply turned repetitive), the bucket goes back to measuring. This
  matters because traffic walks through buckets (8 requests finishing one by one visit buckets 8, 4, 2,
  1), and each measuring bucket pays ``warmup_steps`` drafted steps, which cost ~3 plain steps each at
  batch 8 on a CPU.

Pure Python and deterministic: the same sequence of ``record`` calls gives the same decisions.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    """Knobs of the cost model; the defaults suit step times from a millisecond (GPU) to a second (CPU)."""

    ema_alpha: float = 0.25  # weight of the newest step in each step-time EMA
    accept_window: int = 32  # the accept-length estimate: a running mean over this many requests, then an EMA
    z: float = 3.0  # standard errors of the gain that make a probe's confirmation confident
    # Buckets up to this batch size keep their probe interval while a losing probe is within the gain's error;
    # bigger ones double it after every losing probe, as before session 11. Batch 1 is where the extra probing was
    # measured to pay; above it the timed forward leaves out costs of a drafted step (waiting prompts cannot ride
    # along in it), so a gain near the threshold is less trustworthy there. (The A/Bs did not separate this rule's
    # effect at concurrency 8 from the accept estimate's: docs/benchmarks.md, "The real default", session 11.)
    uncertain_probe_max_batch: int = 1
    warmup_steps: int = 3  # steps of each kind a new bucket measures before it decides
    margin: float = 0.05  # drafting must beat plain throughput by this fraction
    probe_interval: int = 8  # steps between probes of the path not taken, after a switch
    max_probe_interval: int = 128  # the interval doubles while probes keep losing, up to this

    def __post_init__(self) -> None:
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.uncertain_probe_max_batch < 0:
            raise ValueError(f"uncertain_probe_max_batch must be >= 0, got {self.uncertain_probe_max_batch}")
        if self.accept_window < 1:
            raise ValueError(f"accept_window must be >= 1, got {self.accept_window}")
        if not (math.isfinite(self.z) and self.z >= 0.0):
            raise ValueError(f"z must be a finite number >= 0, got {self.z}")
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if not (math.isfinite(self.margin) and self.margin >= 0.0):
            raise ValueError(f"margin must be a finite number >= 0, got {self.margin}")
        if not 1 <= self.probe_interval <= self.max_probe_interval:
            raise ValueError(
                f"need 1 <= probe_interval <= max_probe_interval, got {self.probe_interval}, {self.max_probe_interval}"
            )


@dataclass
class AcceptEstimate:
    """Committed tokens per request per drafted step, counted per request: a running mean over the requests seen
    that becomes an EMA of weight ``batch_size / window`` once ``window`` requests are in, and its standard error.

    A drafted step of b requests observes b acceptances, so it weighs b: a batch-8 step moves the estimate as far
    as 8 batch-1 steps (a running mean over steps kept one easy prompt's 3.0 for dozens of batch-8 steps and had a
    batch-8 bucket draft at a loss). Its mean's variance is the per-request variance over b, so the spread is kept
    per request (the squared deviation times b).
    """

    window: int  # requests
    count: int = 0  # requests seen
    mean: float = 0.0
    var_per_request: float = 0.0

    def add(self, sample: float, batch_size: int = 1) -> None:
        """Fold in one drafted step's mean tokens per request over its ``batch_size`` requests."""
        self.count += batch_size
        a = min(1.0, batch_size / min(self.count, self.window))
        diff = sample - self.mean
        self.mean += a * diff
        self.var_per_request = (1.0 - a) * (self.var_per_request + a * batch_size * diff * diff)

    def stderr(self) -> float:
        """Standard error of the mean; an EMA of per-request weight 1/W averages about 2W - 1 requests."""
        return math.sqrt(self.var_per_request / min(self.count, 2 * self.window - 1))


@dataclass
class BucketState:
    """What one batch-size bucket measured and chose."""

    draft_warmup: list[float] = field(default_factory=list)  # drafted step seconds, until warm
    plain_warmup: list[float] = field(default_factory=list)  # draft-free step seconds, until warm
    t_draft: Optional[float] = None  # EMA seconds of a drafted step
    t_plain: Optional[float] = None  # EMA seconds of a draft-free step
    drafting: Optional[bool] = None  # the current choice (None while measuring)
    inherited_from: Optional[int] = None  # the neighbour bucket whose choice this one started with
    since_probe: int = 0  # steps on the chosen path since the last probe or switch
    interval: int = 0  # steps on the chosen path before the next probe

    def warm(self) -> bool:
        """Both step-time EMAs exist (the bucket can judge from its own timings)."""
        return self.t_draft is not None and self.t_plain is not None


def _cost_ratio(b: BucketState) -> Optional[float]:
    """t_draft / t_plain from the EMAs, else from the warm-up samples so far (None while a kind has none)."""
    t_draft = b.t_draft if b.t_draft is not None else (statistics.median(b.draft_warmup) if b.draft_warmup else None)
    t_plain = b.t_plain if b.t_plain is not None else (statistics.median(b.plain_warmup) if b.plain_warmup else None)
    return None if t_draft is None or t_plain is None else t_draft / t_plain


def bucket_of(batch_size: int) -> int:
    """The smallest power of two >= batch_size (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


class AdaptiveSpeculation:
    """Per batch-size bucket: draft or not, from measured step times and the accept length."""

    def __init__(self, config: Optional[AdaptiveSpecConfig] = None) -> None:
        self.config = config or AdaptiveSpecConfig()
        self.buckets: dict[int, BucketState] = {}
        self.accept = AcceptEstimate(self.config.accept_window)  # committed tokens per request per drafted step

    @property
    def tokens(self) -> Optional[float]:
        """The estimated accept length L (bonus included), None before the first drafted step."""
        return self.accept.mean if self.accept.count else None

    def _bucket(self, batch_size: int) -> BucketState:
        key = bucket_of(batch_size)
        if key not in self.buckets:
            self.buckets[key] = self._new_bucket(key)
        return self.buckets[key]

    def _new_bucket(self, key: int) -> BucketState:
        """A measuring bucket, or one that starts with a decided neighbour's choice (see the module docstring)."""
        decided = {k: b for k, b in self.buckets.items() if b.drafting is not None}
        lower = max((k for k in decided if k < key), default=None)
        upper = min((k for k in decided if k > key), default=None)
        starts_off = lower is not None and decided[lower].drafting is False
        starts_on = upper is not None and decided[upper].drafting is True
        if starts_off == starts_on:  # nothing known, or the neighbours disagree (noise): measure
            return BucketState(interval=self.config.probe_interval)
        src = lower if starts_off else upper
        logger.info(
            "adaptive speculation: batch bucket <= %d starts with drafting %s, like bucket <= %d (the gain does not grow with the batch)",
            key, "on" if starts_on else "off", src,
        )
        return BucketState(drafting=starts_on, inherited_from=src, interval=decided[src].interval)

    def gain(self, batch_size: int) -> float:
        """Drafted over plain throughput (tokens per request per second) of this batch size's bucket, from the EMAs."""
        b = self.buckets.get(bucket_of(batch_size))
        if b is None or not b.warm() or self.tokens is None:
            raise ValueError(f"bucket {bucket_of(batch_size)} has not measured both kinds of step yet")
        return self.tokens * b.t_plain / b.t_draft

    def drafting_off(self, batch_size: int) -> bool:
        """Whether this batch size's bucket has chosen draft-free steps (read-only: creates no bucket, counts no step)."""
        b = self.buckets.get(bucket_of(batch_size))
        return b is not None and b.drafting is False

    def should_draft(self, batch_size: int) -> bool:
        """Whether the next decode step of batch_size requests should run the draft (creates its bucket)."""
        b = self._bucket(batch_size)
        if b.inherited_from is not None and not b.warm() and self.buckets[b.inherited_from].drafting != b.drafting:
            # The neighbour changed its mind before this bucket could judge on its own: measure instead.
            b.drafting, b.inherited_from, b.since_probe, b.interval = None, None, 0, self.config.probe_interval
        if b.drafting is None:  # measuring: drafted steps first, then draft-free ones
            return b.t_draft is None
        if b.since_probe >= self._probe_gap(b):
            return not b.drafting  # a probe of the path not taken
        return b.drafting

    def _probe_gap(self, b: BucketState) -> int:
        """Steps on the chosen path before the next probe: the interval, in plain-step time while drafting is off.

        A bucket that has not timed a drafted step yet (one that started off like its smaller neighbour)
        takes the neighbour's cost ratio, a lower bound of its own (the ratio only grows with the batch).
        """
        if b.drafting is not False:
            return b.interval
        ratio = _cost_ratio(b)
        if ratio is None and b.inherited_from is not None:
            ratio = _cost_ratio(self.buckets[b.inherited_from])
        return math.ceil(b.interval * max(1.0, ratio or 1.0))

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens_per_req: float = 1.0) -> None:
        """Feed one finished decode step: its kind, wall time and (drafted) mean committed tokens per request."""
        if not (math.isfinite(seconds) and seconds > 0.0):
            raise ValueError(f"step seconds must be a finite number > 0, got {seconds}")
        if drafted and not (math.isfinite(tokens_per_req) and tokens_per_req >= 1.0):
            raise ValueError(f"a drafted step commits >= 1 token per request, got {tokens_per_req}")
        key = bucket_of(batch_size)
        b = self._bucket(batch_size)
        if drafted:
            b.t_draft = self._update(b.t_draft, b.draft_warmup, seconds)
            self.accept.add(tokens_per_req, batch_size)
        else:
            b.t_plain = self._update(b.t_plain, b.plain_warmup, seconds)
        if b.drafting is None:  # measuring
            if b.warm():
                b.drafting = self.gain(key) >= 1.0 + self.config.margin
                self._log_choice(key, b, "measured")
            return
        probe = drafted != b.drafting
        b.since_probe = 0 if probe else b.since_probe + 1
        if not b.warm():  # an inherited choice holds until this bucket has timed both paths
            return
        gain = self.gain(key)
        threshold = 1.0 + self.config.margin
        drafts = gain >= threshold
        if drafts == b.drafting:
            # The probe lost; probe less often, at small batches only when the gain is clear of the threshold.
            if probe and (key > self.config.uncertain_probe_max_batch or self._clear_of(gain, threshold)):
                b.interval = min(2 * b.interval, self.config.max_probe_interval)
            return
        b.drafting, b.since_probe, b.interval = drafts, 0, self.config.probe_interval
        self._log_choice(key, b, "switched")

    def _clear_of(self, gain: float, threshold: float) -> bool:
        """Whether the gain is more than z standard errors (of the accept estimate) from the threshold."""
        return abs(gain - threshold) > self.config.z * gain * self.accept.stderr() / self.accept.mean

    def _update(self, ema: Optional[float], warmup: list[float], sample: float) -> Optional[float]:
        """The EMA after one sample; during warm-up, collect and start at the warm-up median."""
        if ema is not None:
            a = self.config.ema_alpha
            return (1.0 - a) * ema + a * sample
        warmup.append(sample)
        if len(warmup) < self.config.warmup_steps:
            return None
        return float(statistics.median(warmup))

    def _log_choice(self, key: int, b: BucketState, how: str) -> None:
        logger.info(
            "adaptive speculation: batch bucket <= %d %s: drafting %s (accept len %.2f in %.4f s vs 1 in %.4f s: %.2fx)",
            key, how, "on" if b.drafting else "off", self.tokens, b.t_draft, b.t_plain, self.gain(key),
        )
