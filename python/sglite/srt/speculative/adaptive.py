"""AdaptiveSpeculation: a measured cost model that turns DFLASH/DSPARK drafting off when it does not pay.

Contract. The worker asks ``next_step(batch_size)`` before each decode step and gets a ``StepKind``: PLAIN (the
target alone, one token a request), DRAFTED (draft block + a verify of W tokens a request, 1..W tokens a request) or
SHADOW (draft block + the target alone, a probe whose drafts are scored later). It reports each finished step with
``record`` / ``record_shadow`` / ``record_shadow_accept``, and may time buckets before serving with ``calibrate``.
Output is the same whichever kind runs: the cost model only chooses which path computes it. Pure Python and
deterministic: the same sequence of calls gives the same decisions.

State. One estimate of the accept length ``L`` (tokens a drafted step commits per request, bonus included), since
the draft's quality on the traffic does not depend on how many requests share a step; and per batch-size bucket
(powers of two, ``bucket_of``) EMAs of the wall time of a drafted and of a draft-free step. ``L`` is noisy (a step
commits 1 to W tokens a request) while step times are steady, so it is counted per request (a batch-8 step observes
8 acceptances) in a running mean that becomes an EMA after ``accept_window`` requests, with its variance, so the gain
has a standard error.

Decision rule. A bucket drafts while its gain ``L * t_plain / t_draft`` is at least ``1 + margin``; the margin keeps a
draft that is only as fast as plain off, because the timed forwards leave out costs a drafted step has beyond them
(prompts cannot ride along in its forward). The same threshold turns drafting off.

How a bucket gets its times, cheapest first:
- Calibrated (``calibrate``, from ``step_calibration.py``): timed before serving, so it is warm and decides as soon
  as a drafted step has sampled ``L``. A warm bucket whose drafted step costs more than ``W / (1 + margin)`` plain
  steps (W: ``max_tokens_per_step``) can never pay: it is off whatever ``L`` is, probes only at
  ``max_probe_interval`` with drafted steps (to re-time it), and the buckets above it start off too.
- Settled by neighbours: the gain cannot grow with the batch (``L`` does not depend on it, and a drafted step's
  relative cost ``t_draft / t_plain`` only grows: its W - 1 extra verify tokens a request ride on weight reads at
  small batches and cost full compute at large ones). So the nearest decided smaller bucket's cost ratio bounds a
  bucket's from below and the nearest bigger one's from above; between a paying smaller and a losing bigger bucket
  the ratio is interpolated in log2 of the batch and decides when the gain is clear (``clear_band`` from the
  threshold). Such a bucket takes the probe interval of the neighbour with the same choice, times the path it runs,
  and switches to its own timings once they are clear or warm; if its neighbours stop settling it, it measures.
- Measured: a drafted and a draft-free step in turn until it has ``warmup_steps`` of each, each EMA starting at the
  median of its samples (a cold first step is outvoted); it decides after one step of each kind when the gain is
  clear and the accept estimate covers ``accept_window`` requests.

Probes. The path not taken is still sampled, one step every ``interval`` steps, so a draft that starts to pay (a
repetitive reply, a lighter batch) is noticed and plain timings do not go stale. While drafting is off a probe is a
shadow step once an accept estimate exists: the draft block runs, the target decodes alone, and the drafts are scored
against the tokens the target goes on to produce, which is what a verify would have committed (greedy: the same
prefix match; sampled: a draft is accepted with the target's probability of sampling it). It does not re-time the
drafted step. Each probe kind is priced by its time beyond plain steps committing the same tokens (``t_shadow -
t_plain`` against ``t_draft - L * t_plain``), and a bucket that has timed a shadow step probes with the cheaper one.
A probe that confirms the current choice with confidence (the gain ``z`` standard errors from the threshold that
would flip it) doubles the interval, up to ``max_probe_interval``; at batch sizes up to ``uncertain_probe_max_batch``
one that confirms it only within the gain's error keeps the interval, so a marginal draft is sampled until the
estimate settles; a probe that flips the choice resets it. While drafting is off the interval counts plain-step time
(a drafted probe costs ``t_draft / t_plain`` plain steps), stretched by how far ``L`` falls short of paying, so every
bucket spends a similar small share of its time probing.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence

from sglite.srt.speculative.accept_estimate import AcceptEstimate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    """Knobs of the cost model; the defaults suit step times from a millisecond (GPU) to a second (CPU)."""

    ema_alpha: float = 0.25  # weight of the newest step in each step-time EMA
    accept_window: int = 32  # the accept-length estimate: a running mean over this many requests, then an EMA
    z: float = 3.0  # standard errors of the gain that make a probe's confirmation confident
    # Buckets up to this batch size keep their probe interval while a losing probe is within the gain's error;
    # bigger ones double it after every losing probe. Above batch 1 the timed forward leaves out costs of a drafted
    # step (waiting prompts cannot ride along in it), so a gain near the threshold is less trustworthy there.
    uncertain_probe_max_batch: int = 1
    warmup_steps: int = 3  # steps of each kind whose median starts a step-time EMA (a cold first step is outvoted)
    # A gain this far (relative) from the threshold is acted on before warmup_steps of each kind are in, from the
    # samples so far or a prior from timed neighbours: a cold first step or an interpolated cost is off by less.
    clear_band: float = 0.25
    margin: float = 0.05  # drafting must beat plain throughput by this fraction
    probe_interval: int = 8  # steps between probes of the path not taken, after a switch
    max_probe_interval: int = 128  # the interval doubles while probes keep losing, up to this
    # While drafting is off, probe with shadow steps (drafts scored against the target's own next tokens) instead
    # of drafted ones. False: every probe of a draft-free bucket is a drafted step.
    shadow_probes: bool = True
    # Buckets up to this batch size are timed at start-up (``calibrate``: a drafted and a draft-free step on dummy
    # batches), so they decide as soon as the accept length is known instead of measuring with drafted steps;
    # 0: none, every bucket measures live.
    calibrate_max_batch_size: int = 32

    def __post_init__(self) -> None:
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.uncertain_probe_max_batch < 0:
            raise ValueError(f"uncertain_probe_max_batch must be >= 0, got {self.uncertain_probe_max_batch}")
        if self.accept_window < 1:
            raise ValueError(f"accept_window must be >= 1, got {self.accept_window}")
        if not (math.isfinite(self.z) and self.z >= 0.0):
            raise ValueError(f"z must be a finite number >= 0, got {self.z}")
        if not 0.0 <= self.clear_band < 1.0:
            raise ValueError(f"clear_band must be in [0, 1), got {self.clear_band}")
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if not (math.isfinite(self.margin) and self.margin >= 0.0):
            raise ValueError(f"margin must be a finite number >= 0, got {self.margin}")
        if self.calibrate_max_batch_size < 0:
            raise ValueError(f"calibrate_max_batch_size must be >= 0, got {self.calibrate_max_batch_size}")
        if not 1 <= self.probe_interval <= self.max_probe_interval:
            raise ValueError(
                f"need 1 <= probe_interval <= max_probe_interval, got {self.probe_interval}, {self.max_probe_interval}"
            )


class StepKind(Enum):
    """What the next decode step of a bucket runs."""

    PLAIN = "plain"  # the target alone: one token a request
    DRAFTED = "drafted"  # draft block + verify of W tokens a request: 1..W tokens a request
    SHADOW = "shadow"  # draft block + the target alone: one token a request, the drafts scored later (a probe)


@dataclass
class BucketState:
    """What one batch-size bucket measured and chose."""

    draft_warmup: list[float] = field(default_factory=list)  # drafted step seconds, until warm
    plain_warmup: list[float] = field(default_factory=list)  # draft-free step seconds, until warm
    t_draft: Optional[float] = None  # EMA seconds of a drafted step
    t_plain: Optional[float] = None  # EMA seconds of a draft-free step
    shadow_warmup: list[float] = field(default_factory=list)  # shadow step seconds, until warm
    t_shadow: Optional[float] = None  # EMA seconds of a shadow step (a draft-free step plus the draft block)
    drafting: Optional[bool] = None  # the current choice (None while measuring)
    prior: Optional["CostPrior"] = None  # what timed neighbours said when this bucket took their choice
    since_probe: int = 0  # steps on the chosen path since the last probe or switch
    interval: int = 0  # steps on the chosen path before the next probe
    calibrated: bool = False  # its step times were first timed at start-up (``calibrate``)
    switches: int = 0  # flips of the choice after the first (each is logged; at INFO only the 1st, 2nd, 4th, ...)

    def warm(self) -> bool:
        """Both step-time EMAs exist (the bucket can judge from its own timings)."""
        return self.t_draft is not None and self.t_plain is not None


@dataclass(frozen=True)
class CostPrior:
    """A bucket's drafted-step cost in plain steps (t_draft / t_plain) as its timed neighbours bound or interpolate it,
    and the choice it implies at the current accept length."""

    ratio: float
    drafting: bool
    sources: tuple[int, ...]  # the timed buckets it comes from: one (a bound) or two (an interpolation)
    interval: int  # the probe interval of the neighbour that made the same choice


def _seconds(ema: Optional[float], warmup: list[float]) -> Optional[float]:
    """A step time: the EMA, else the median of the warm-up samples so far (None before the first)."""
    if ema is not None:
        return ema
    return float(statistics.median(warmup)) if warmup else None


def _cost_ratio(b: BucketState) -> Optional[float]:
    """t_draft / t_plain from the EMAs, else from the warm-up samples so far (None while a kind has none)."""
    t_draft, t_plain = _seconds(b.t_draft, b.draft_warmup), _seconds(b.t_plain, b.plain_warmup)
    return None if t_draft is None or t_plain is None else t_draft / t_plain


def _check_step_seconds(seconds: float) -> None:
    """A step's wall time must be a finite number of seconds > 0."""
    if not (math.isfinite(seconds) and seconds > 0.0):
        raise ValueError(f"step seconds must be a finite number > 0, got {seconds}")


def _check_tokens_per_request(tokens_per_req: float) -> None:
    """A drafted step (or a shadow step's scored drafts) commits at least one token per request."""
    if not (math.isfinite(tokens_per_req) and tokens_per_req >= 1.0):
        raise ValueError(f"a drafted step commits >= 1 token per request, got {tokens_per_req}")


def bucket_of(batch_size: int) -> int:
    """The smallest power of two >= batch_size (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


class AdaptiveSpeculation:
    """Per batch-size bucket: draft or not, from measured step times and the accept length."""

    def __init__(self, config: Optional[AdaptiveSpecConfig] = None, max_tokens_per_step: Optional[int] = None) -> None:
        self.config = config or AdaptiveSpecConfig()
        if max_tokens_per_step is not None and max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        # The most a drafted step commits per request (the verify width W: every draft accepted, plus the bonus).
        # A bucket whose drafted step costs more than W / (1 + margin) plain steps can never pay (None: no bound).
        self.max_tokens_per_step = max_tokens_per_step
        self.buckets: dict[int, BucketState] = {}
        self.accept = AcceptEstimate(self.config.accept_window)  # committed tokens per request per drafted step

    @property
    def threshold(self) -> float:
        """The gain (drafted over plain throughput) at or above which a bucket drafts: 1 + margin."""
        return 1.0 + self.config.margin

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
        """A measuring bucket, or one that starts with the choice its timed neighbours settle (``_prior``)."""
        prior = self._prior(key)
        if prior is None:
            return BucketState(interval=self.config.probe_interval)
        logger.info(
            "adaptive speculation: batch bucket <= %d starts with drafting %s: cost %.2f plain steps (%s bucket %s), "
            "accept len %s",
            key, "on" if prior.drafting else "off", prior.ratio,
            "bound by" if len(prior.sources) == 1 else "interpolated between",
            " and ".join(map(str, prior.sources)),
            "not measured yet" if self.tokens is None else f"{self.tokens:.2f}",  # None before any drafted step
        )
        return BucketState(drafting=prior.drafting, prior=prior, interval=prior.interval)

    def _prior(self, key: int) -> Optional[CostPrior]:
        """The choice for bucket ``key`` that its nearest decided and timed neighbours settle, if they do.

        A drafted step's cost in plain steps only grows with the batch, so a smaller neighbour's ratio bounds this
        bucket's from below (when it already loses at the current accept length, or can never pay, so does this
        one) and a bigger one's from above (when it still pays, so does this one). Between a paying smaller
        neighbour and a losing bigger one the ratio is interpolated in log2 of the batch, and settles the choice
        only when the gain it gives is clear of the threshold (``_clear``).
        """
        timed = {
            k: r for k, b in self.buckets.items()
            if k != key and b.drafting is not None and (r := _cost_ratio(b)) is not None
        }
        lower = max((k for k in timed if k < key), default=None)
        upper = min((k for k in timed if k > key), default=None)
        if lower is not None and self.buckets[lower].warm() and self._ratio_never_pays(timed[lower]):
            return CostPrior(timed[lower], False, (lower,), self.config.max_probe_interval)
        if self.tokens is None:
            return None
        threshold = self.threshold
        if lower is not None and self.tokens / timed[lower] < threshold:
            return CostPrior(timed[lower], False, (lower,), self.buckets[lower].interval)
        if upper is not None and self.tokens / timed[upper] >= threshold:
            return CostPrior(timed[upper], True, (upper,), self.buckets[upper].interval)
        if lower is None or upper is None:
            return None
        at = (key.bit_length() - lower.bit_length()) / (upper.bit_length() - lower.bit_length())
        ratio = timed[lower] + at * (timed[upper] - timed[lower])
        gain = self.tokens / ratio
        if not self._clear(gain, threshold):
            return None
        drafting = gain >= threshold
        return CostPrior(ratio, drafting, (lower, upper), self.buckets[lower if drafting else upper].interval)

    def gain(self, batch_size: int) -> float:
        """Drafted over plain throughput (tokens per request per second) of this batch size's bucket, from the EMAs."""
        b = self.buckets.get(bucket_of(batch_size))
        if b is None or not b.warm() or self.tokens is None:
            raise ValueError(f"bucket {bucket_of(batch_size)} has not measured both kinds of step yet")
        return self._own_gain(b)  # warm: the EMAs' ratio, the very number record() decides on

    def _own_gain(self, b: BucketState) -> Optional[float]:
        """The gain from this bucket's own timings, warm or provisional (None while a kind has no sample)."""
        ratio = _cost_ratio(b)
        return None if ratio is None or self.tokens is None else self.tokens / ratio

    def drafting_off(self, batch_size: int) -> bool:
        """Whether this batch size's bucket has chosen draft-free steps (read-only: creates no bucket, counts no step)."""
        b = self.buckets.get(bucket_of(batch_size))
        return b is not None and b.drafting is False

    def next_step(self, batch_size: int) -> StepKind:
        """What the next decode step of batch_size requests runs (creates its bucket)."""
        key = bucket_of(batch_size)
        b = self._bucket(batch_size)
        if b.prior is not None:
            # A choice taken from neighbours lasts while they still settle it (the accept length or their timings
            # move); the bucket's own timings take over in ``record`` once they are clear or warm.
            prior = self._prior(key)
            if prior is None or prior.drafting != b.drafting:
                b.drafting, b.prior, b.since_probe, b.interval = None, None, 0, self.config.probe_interval
                logger.info("adaptive speculation: batch bucket <= %d: its neighbours no longer settle it; measuring", key)
            else:
                b.prior = prior
        if b.drafting is None and b.warm():
            # Calibrated: both step times are known, so the accept length alone decides; before the first drafted
            # step there is none, and this step measures it.
            self._judge(key, b, False, "calibrated")
            if b.drafting is None:
                return StepKind.DRAFTED
        if b.drafting is None:
            # Measuring: a drafted and a draft-free step in turn (a clear gain shows after two), until both are warm.
            drafts = b.t_draft is None and (b.t_plain is not None or len(b.draft_warmup) <= len(b.plain_warmup))
            return StepKind.DRAFTED if drafts else StepKind.PLAIN
        if b.since_probe < self._probe_gap(b):
            return StepKind.DRAFTED if b.drafting else StepKind.PLAIN
        return StepKind.PLAIN if b.drafting else self._probe_while_off(b)  # a probe of the path not taken

    def _probe_while_off(self, b: BucketState) -> StepKind:
        """A draft-free bucket's probe: a shadow step where only the accept length is in question, a drafted one
        where the bucket must time drafting to judge (its choice came from neighbours, its early verdict from one
        drafted step is no longer clear at the current accept length, or its cost alone rules drafting out)."""
        if not self.config.shadow_probes or self.tokens is None or b.prior is not None or self._never_pays(b):
            return StepKind.DRAFTED  # (a bucket that can never pay probes only to re-time its drafted step)
        if b.t_draft is None:
            gain = self._own_gain(b)
            if gain is None or not self._clear(gain, self.threshold):
                return StepKind.DRAFTED
        t_shadow = _seconds(b.t_shadow, b.shadow_warmup)
        if t_shadow is None:
            return StepKind.SHADOW  # its price is learnt by running one
        # Each probe's price: its time beyond plain steps that commit the same tokens.
        t_draft, t_plain = _seconds(b.t_draft, b.draft_warmup), _seconds(b.t_plain, b.plain_warmup)
        return StepKind.SHADOW if t_shadow - t_plain < t_draft - self.tokens * t_plain else StepKind.DRAFTED

    def _probe_gap(self, b: BucketState) -> int:
        """Steps on the chosen path before the next probe: the interval, in plain-step time while drafting is off.

        A bucket that has not timed a drafted step yet (one that started off like its neighbours) takes its prior's
        cost ratio, a lower bound or an interpolation of its own.
        """
        if b.drafting is not False:
            return b.interval
        ratio = _cost_ratio(b)
        if ratio is None and b.prior is not None:
            ratio = b.prior.ratio
        ratio = max(1.0, ratio or 1.0)
        # The further from paying, the rarer the probes: drafting pays again only once L reaches
        # (1 + margin) x ratio, so a bucket that needs L to double probes half as often.
        shortfall = max(1.0, self.threshold * ratio / self.tokens) if self.tokens else 1.0
        return math.ceil(b.interval * ratio * shortfall)

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens_per_req: float = 1.0) -> None:
        """Feed one finished decode step: its kind, wall time and (drafted) mean committed tokens per request."""
        _check_step_seconds(seconds)
        if drafted:
            _check_tokens_per_request(tokens_per_req)
        key = bucket_of(batch_size)
        b = self._bucket(batch_size)
        if drafted:
            b.t_draft = self._update(b.t_draft, b.draft_warmup, seconds)
            self.accept.add(tokens_per_req, batch_size)
        else:
            b.t_plain = self._update(b.t_plain, b.plain_warmup, seconds)
        probe = b.drafting is not None and drafted != b.drafting
        if b.drafting is not None:
            b.since_probe = 0 if probe else b.since_probe + 1
        self._judge(key, b, probe, "switched")

    def record_shadow(self, batch_size: int, seconds: float) -> None:
        """A shadow step ran (the probe of a draft-free bucket) in ``seconds``; its drafts come back through
        ``record_shadow_accept``. Its time prices shadow probes; it is not a plain step's (it holds the draft block)."""
        _check_step_seconds(seconds)
        b = self._bucket(batch_size)
        if b.drafting is not False:
            raise ValueError(f"a shadow step probes a draft-free bucket; bucket {bucket_of(batch_size)} is not one")
        b.t_shadow = self._update(b.t_shadow, b.shadow_warmup, seconds)
        b.since_probe = 0

    def record_shadow_accept(self, batch_size: int, tokens_per_req: float, num_requests: int) -> None:
        """Feed a shadow step's scored drafts: the mean tokens a verify would have committed over ``num_requests``.

        It moves the accept estimate as a drafted step's would, and the bucket it probed judges its choice again,
        as after a drafted probe (``batch_size`` is that step's).
        """
        if num_requests < 1:
            raise ValueError(f"a shadow step scores >= 1 request, got {num_requests}")
        _check_tokens_per_request(tokens_per_req)
        self.accept.add(tokens_per_req, num_requests)
        key = bucket_of(batch_size)
        b = self.buckets.get(key)
        if b is not None and b.drafting is False:
            self._judge(key, b, True, "switched (shadow probe)")

    def _judge(self, key: int, b: BucketState, probe: bool, how: str) -> None:
        """Decide, confirm or flip the bucket's choice from its own timings and the accept estimate."""
        if self._never_pays(b):
            # Off whatever the accept length: probed only at the longest interval, to re-time the drafted step.
            switched = b.drafting is not False
            b.drafting, b.prior, b.interval = False, None, self.config.max_probe_interval
            if switched:
                b.since_probe = 0
                self._log_choice(key, b, how + ", can never pay")
            return
        gain = self._own_gain(b)
        threshold = self.threshold
        if gain is None or not (b.warm() or self._clear(gain, threshold)):
            return  # measuring, or a neighbour's choice: until warm, the bucket's own timings act only when clear
        drafts = gain >= threshold
        if b.drafting is None:
            b.drafting = drafts
            self._log_choice(key, b, ("calibrated" if b.calibrated else "measured") if b.warm() else "measured (clear early)")
            return
        b.prior = None  # its own timings decide from here on
        if drafts == b.drafting:
            # The probe lost; probe less often, at small batches only when the gain is clear of the threshold.
            if probe and (key > self.config.uncertain_probe_max_batch or self._clear_of(gain, threshold)):
                b.interval = min(2 * b.interval, self.config.max_probe_interval)
            return
        b.drafting, b.since_probe, b.interval = drafts, 0, self.config.probe_interval
        b.switches += 1  # a gain at the threshold flips at most probes (bucket 1 of the default pair: ~60 per 32 requests)
        self._log_choice(key, b, how, b.switches)

    def _never_pays(self, b: BucketState) -> bool:
        """Whether the bucket's own warm timings rule drafting out at any accept length (``max_tokens_per_step``)."""
        return b.warm() and self._ratio_never_pays(b.t_draft / b.t_plain)  # type: ignore[operator]

    def _ratio_never_pays(self, ratio: float) -> bool:
        """Whether a drafted step of this cost in plain steps loses even when every draft is accepted."""
        return self.max_tokens_per_step is not None and self.max_tokens_per_step / ratio < self.threshold

    def calibrate(self, batch_size: int, draft_seconds: Sequence[float], plain_seconds: Sequence[float]) -> None:
        """Start a bucket's step-time EMAs at the medians of drafted and draft-free steps timed before serving.

        The bucket is then warm: it decides as soon as the accept length is known (at once if it can never pay),
        and its live steps move the EMAs from there.
        """
        if not draft_seconds or not plain_seconds:
            raise ValueError("calibrating a bucket needs at least one drafted and one draft-free step time")
        for seconds in (*draft_seconds, *plain_seconds):
            _check_step_seconds(seconds)
        key = bucket_of(batch_size)
        b = BucketState(
            t_draft=float(statistics.median(draft_seconds)), t_plain=float(statistics.median(plain_seconds)),
            interval=self.config.probe_interval, calibrated=True,
        )
        self.buckets[key] = b
        logger.info(
            "adaptive speculation: batch bucket <= %d calibrated at batch %d: drafted step %.4f s, draft-free %.4f s "
            "(%.2f plain steps)", key, batch_size, b.t_draft, b.t_plain, b.t_draft / b.t_plain,
        )
        self._judge(key, b, False, "calibrated")

    def _clear(self, gain: float, threshold: float) -> bool:
        """Whether a gain from provisional costs (few samples, or a neighbours' prior) is clear enough to act on.

        It must be more than ``clear_band`` (relative) from the threshold, with an accept estimate over at least
        ``accept_window`` requests (one early request's acceptance says little) and z standard errors clear.
        """
        return (
            self.accept.count >= self.config.accept_window
            and abs(gain / threshold - 1.0) > self.config.clear_band
            and self._clear_of(gain, threshold)
        )

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

    def _log_choice(self, key: int, b: BucketState, how: str, switch: int = 0) -> None:
        t_draft, t_plain = _seconds(b.t_draft, b.draft_warmup), _seconds(b.t_plain, b.plain_warmup)
        if self.tokens is None:  # ruled out by its cost alone, before any drafted step
            logger.info(
                "adaptive speculation: batch bucket <= %d %s: drafting off (a drafted step costs %.2f plain steps, "
                "%.4f s vs %.4f s, and commits at most %s tokens a request)",
                key, how, t_draft / t_plain, t_draft, t_plain, self.max_tokens_per_step,
            )
            return
        logger.log(
            logging.DEBUG if switch & (switch - 1) else logging.INFO,  # flips: INFO for a bucket's 1st, 2nd, 4th, ...
            "adaptive speculation: batch bucket <= %d %s: drafting %s (accept len %.2f in %.4f s vs 1 in %.4f s: %.2fx)%s",
            key, how, "on" if b.drafting else "off", self.tokens, t_draft, t_plain, self._own_gain(b),
            f"; switch {switch}" if switch else "",
        )
