"""AdaptiveSpeculation, the measured cost model of --speculative-adaptive, fed synthetic step timings."""

import dataclasses
import logging
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglite.srt.speculative.adaptive import (
    AdaptiveSpecConfig,
    AdaptiveSpeculation,
    StepKind,
    bucket_of,
)

SUITE = "unit-cpu"
EST_TIME = 1

CFG = AdaptiveSpecConfig(ema_alpha=0.25, warmup_steps=3, margin=0.05, probe_interval=4, max_probe_interval=16)


def step(policy, bs, t_draft, tokens, t_plain, t_block=None):
    """One decode step whose drafted/plain/shadow costs are fixed (the draft block: a tenth of a plain step unless
    given); a shadow step's drafts are scored at once. Its kind."""
    kind = policy.next_step(bs)
    if kind is StepKind.SHADOW:
        policy.record_shadow(bs, t_plain + (0.1 * t_plain if t_block is None else t_block))
        policy.record_shadow_accept(bs, tokens, bs)
    else:
        drafted = kind is StepKind.DRAFTED
        policy.record(bs, drafted, t_draft if drafted else t_plain, tokens if drafted else 1.0)
    return kind


def drive(policy, bs, steps, t_draft, tokens, t_plain):
    """Run `steps` decode steps; return whether each ran the draft block (a drafted or a shadow step)."""
    return [step(policy, bs, t_draft, tokens, t_plain) is not StepKind.PLAIN for _ in range(steps)]


def gaps(kinds, value):
    """Positions of `value` in kinds, as distances between consecutive ones."""
    at = [i for i, k in enumerate(kinds) if k == value]
    return [b - a for a, b in zip(at, at[1:])]


def test_warmup_alternates_drafted_and_plain_steps_then_decides():
    p = AdaptiveSpeculation(CFG)
    kinds = drive(p, 1, 6, t_draft=0.15, tokens=1.3, t_plain=0.10)
    assert kinds == [True, False] * 3
    assert p.buckets[1].drafting is False and p.gain(1) == pytest.approx(1.3 * 0.10 / 0.15)


def test_a_losing_draft_is_turned_off_and_probed_ever_less_often_up_to_the_bound():
    p = AdaptiveSpeculation(CFG)
    kinds = drive(p, 1, 200, t_draft=0.15, tokens=1.3, t_plain=0.10)[6:]
    # Off after warm-up; each probe (one drafted step) loses, doubling the interval: 4, 8, 16, then 16 (the
    # bound), counted in plain-step time: a drafted probe costs 1.5 plain steps, and drafting would pay only at an
    # accept length 1.05 x 1.5 / 1.3 = 1.21 times this one, so 8 x 1.82 = 15, then 16 x 1.82 = 30 steps.
    assert kinds.count(True) < len(kinds) // 15
    assert gaps(kinds, True)[:5] == [16, 31, 31, 31, 31]  # steps on the chosen path + the probe itself
    assert kinds[:9] == [False] * 8 + [True]  # the first interval: ceil(4 x 1.5 x 1.21)
    assert p.buckets[1].interval == CFG.max_probe_interval


def test_a_winning_draft_stays_on_and_probes_plain_now_and_then():
    p = AdaptiveSpeculation(CFG)
    kinds = drive(p, 1, 100, t_draft=0.12, tokens=2.5, t_plain=0.10)[6:]
    assert p.buckets[1].drafting is True
    assert 0 < kinds.count(False) <= 8  # plain probes keep t_plain fresh, and grow rarer
    assert gaps(kinds, False)[:3] == [9, 17, 17]


def test_drafting_comes_back_when_a_probe_finds_it_pays():
    """A repetitive reply: acceptance jumps while drafting is off; the next probe notices and drafting resumes."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 40, t_draft=0.15, tokens=1.3, t_plain=0.10)
    assert p.buckets[1].drafting is False
    kinds = []
    while p.buckets[1].drafting is False:
        kinds += drive(p, 1, 1, t_draft=0.15, tokens=6.0, t_plain=0.10)
    assert kinds.index(True) == len(kinds) - 1 <= 1.5 * CFG.max_probe_interval  # the first probe switched it on
    assert p.buckets[1].interval == CFG.probe_interval  # reset on the switch
    assert all(drive(p, 1, CFG.probe_interval, t_draft=0.15, tokens=6.0, t_plain=0.10))
    # ... and off again once acceptance falls back, within two accept windows of steps (the estimate is slow on
    # purpose: a single step's tokens are noisy).
    steps = 0
    while p.buckets[1].drafting is True:
        drive(p, 1, 1, t_draft=0.15, tokens=1.0, t_plain=0.10)
        steps += 1
    assert CFG.accept_window // 4 < steps <= 2 * CFG.accept_window


def test_buckets_are_powers_of_two_and_measure_when_neighbours_do_not_settle_them():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="batch size"):
        bucket_of(0)
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 20, t_draft=0.12, tokens=2.0, t_plain=0.10)  # small batches: the draft wins
    drive(p, 5, 10, t_draft=0.50, tokens=1.5, t_plain=0.20)  # bucket 8: it loses
    drive(p, 8, 10, t_draft=0.50, tokens=1.5, t_plain=0.20)  # same bucket as 5
    assert sorted(p.buckets) == [1, 8]
    assert p.buckets[1].drafting is True and p.buckets[8].drafting is False
    # Bucket 4 is new; its smaller neighbour drafts and its bigger one does not, which bounds nothing: it
    # measures, drafting first.
    assert p.next_step(1) is StepKind.DRAFTED and p.next_step(3) is StepKind.DRAFTED
    assert p.buckets[4].drafting is None and p.buckets[4].prior is None


def test_the_accept_length_is_one_estimate_over_all_buckets():
    """L measures the draft on the traffic, not the batch: every bucket's drafted steps feed (and use) one estimate."""
    p = AdaptiveSpeculation(CFG)
    for bs, tokens in [(1, 2.0), (1, 2.2), (8, 1.4), (8, 1.0), (2, 3.0)]:
        p.record(bs, True, 0.1, tokens)
    # A running mean over requests while fewer than accept_window are in: a batch-8 step weighs 8.
    assert p.tokens == pytest.approx((2.0 + 2.2 + 8 * 1.4 + 8 * 1.0 + 2 * 3.0) / 20)

    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 6, t_draft=0.1, tokens=3.0, t_plain=0.1)  # bucket 1: L = 3, drafting on
    assert p.buckets[1].drafting is True and p.tokens == pytest.approx(3.0)
    # Bucket 8's three drafted steps accept nothing: 24 requests that outweigh bucket 1's 3 in the shared
    # estimate, so bucket 8 does not draft (one easy prompt before a batch does not set the batch's L).
    drive(p, 8, 6, t_draft=0.15, tokens=1.0, t_plain=0.1)
    shared = (3 * 3.0 + 24 * 1.0) / 27
    assert p.tokens == pytest.approx(shared) and p.gain(8) == pytest.approx(shared * 0.1 / 0.15)
    assert p.buckets[8].drafting is False


def test_a_bigger_bucket_starts_off_when_a_smaller_one_does_not_draft():
    """Traffic that grows from 1 to 8 requests: bucket 8 skips the drafted warm-up (3 steps at ~3x plain cost)."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 60, t_draft=0.15, tokens=1.3, t_plain=0.10)
    assert p.buckets[1].drafting is False and p.buckets[1].interval == CFG.max_probe_interval
    kinds = drive(p, 8, 40, t_draft=0.45, tokens=1.3, t_plain=0.15)
    b = p.buckets[8]
    assert b.prior.sources == (1,) and b.drafting is False and b.interval == CFG.max_probe_interval
    # The first drafted step is the probe after the interval taken from bucket 1, not a warm-up; it counts plain-step
    # time at bucket 1's cost ratio (1.5, a lower bound of bucket 8's) and the shortfall of the accept length at
    # it (1.05 x 1.5 / 1.3), the next one at bucket 8's own (3).
    first = math.ceil(CFG.max_probe_interval * 1.5 * (1.05 * 1.5 / 1.3))
    assert kinds.index(True) == first and kinds.count(True) == 1 and first + 1 + 3 * CFG.max_probe_interval > 40
    assert b.t_plain == pytest.approx(0.15) and b.t_draft is None  # drafting warms through probes only
    fresh = drive(AdaptiveSpeculation(CFG), 8, 40, t_draft=0.45, tokens=1.3, t_plain=0.15)
    assert fresh[:6] == [True, False] * 3 and fresh.count(True) > kinds.count(True)


def test_a_smaller_bucket_starts_on_when_a_bigger_one_drafts():
    p = AdaptiveSpeculation(CFG)
    drive(p, 8, 20, t_draft=0.20, tokens=3.0, t_plain=0.15)
    assert p.buckets[8].drafting is True
    n = p.buckets[8].interval
    kinds = drive(p, 2, 1, t_draft=0.12, tokens=3.0, t_plain=0.10)
    assert p.buckets[2].prior.sources == (8,) and p.buckets[2].drafting is True
    kinds += drive(p, 2, n, t_draft=0.12, tokens=3.0, t_plain=0.10)
    assert kinds == [True] * n + [False]  # no draft-free warm-up: plain is timed by the probe after n steps
    # One step of each kind and a clear gain (3.0 x 0.10 / 0.12 = 2.5): the bucket's own timings take over.
    assert p.buckets[2].prior is None and p.buckets[2].drafting is True


def test_a_choice_from_neighbours_yields_to_the_buckets_own_timings():
    """If the ordering does not hold (the draft pays at 8 but not at 1), bucket 8 finds out once its probes
    have timed drafting warmup_steps times, and switches."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 60, t_draft=0.15, tokens=1.3, t_plain=0.10)
    kinds = drive(p, 8, 4 * (CFG.max_probe_interval + 1), t_draft=0.15, tokens=1.3, t_plain=0.30)
    b = p.buckets[8]
    assert b.prior is None and b.drafting is True and b.t_draft == pytest.approx(0.15)
    # The third probe warmed t_draft and switched; the first waited for bucket 1's cost ratio (1.5, and the
    # accept length's shortfall at it), the next ones for bucket 8's own (0.5: plain-step count, no shortfall).
    first_on = math.ceil(CFG.max_probe_interval * 1.5 * (1.05 * 1.5 / 1.3)) + 1 + 2 * (CFG.max_probe_interval + 1)
    assert kinds[:first_on].count(True) == 3 and all(kinds[first_on:first_on + CFG.probe_interval])


def test_a_choice_from_neighbours_lasts_only_while_they_settle_it():
    """Bucket 1 switches drafting on (the reply turned repetitive) before bucket 8's probes could time drafting:
    bucket 8 no longer follows an "off" that nothing supports, and measures, drafting first."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 60, t_draft=0.15, tokens=1.3, t_plain=0.10)
    drive(p, 8, 5, t_draft=0.45, tokens=1.3, t_plain=0.15)
    assert p.buckets[8].prior.sources == (1,) and p.next_step(8) is StepKind.PLAIN
    while p.buckets[1].drafting is False:
        drive(p, 1, 1, t_draft=0.15, tokens=6.0, t_plain=0.10)
    b = p.buckets[8]
    assert p.next_step(8) is StepKind.DRAFTED and b.drafting is None and b.prior is None
    assert b.t_plain == pytest.approx(0.15)  # what it measured is kept: only the drafted warm-up is left
    kinds = drive(p, 8, 4, t_draft=0.45, tokens=6.0, t_plain=0.15)
    assert kinds[:3] == [True, True, True] and b.drafting is True


def test_an_unsettled_bucket_does_not_settle_others():
    """A bucket still measuring is no neighbour: bucket 4 measures while bucket 2 below it has not decided."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 2, 4, t_draft=0.15, tokens=1.3, t_plain=0.10)
    assert p.buckets[2].drafting is None
    assert p.next_step(4) is StepKind.DRAFTED and p.buckets[4].prior is None and p.buckets[4].drafting is None


def test_a_clear_gain_decides_after_one_step_of_each_kind():
    """Batch 32 on a CPU: a drafted step costs ~4.3 plain ones, so one step of each kind shows the draft losing
    by far more than a cold step could explain; the bucket skips the other two drafted warm-up steps."""
    p = AdaptiveSpeculation(CFG)
    assert drive(p, 32, 2, t_draft=0.435, tokens=2.0, t_plain=0.10) == [True, False]
    b = p.buckets[32]
    assert b.drafting is False and not b.warm() and p.accept.count == 32
    # Later samples finish the warm-up median through probes, as for any bucket.
    assert b.draft_warmup == [0.435] and b.plain_warmup == [0.10]


@pytest.mark.parametrize(
    "bs, t_draft, why",
    [(4, 0.435, "an accept estimate over 4 requests says little"), (32, 0.25, "gain 0.8: within the band")],
)
def test_an_unclear_gain_measures_until_warm(bs, t_draft, why):
    p = AdaptiveSpeculation(CFG)
    assert drive(p, bs, 5, t_draft=t_draft, tokens=2.0, t_plain=0.10) == [True, False, True, False, True], why
    assert p.buckets[bs].drafting is None
    drive(p, bs, 1, t_draft=t_draft, tokens=2.0, t_plain=0.10)
    assert p.buckets[bs].warm() and p.buckets[bs].drafting is False


def test_a_bucket_between_a_paying_and_a_losing_one_interpolates_its_cost():
    """A wave of 32 requests that finish one by one falls through buckets 16, 8, 4 and 2. Between bucket 1 (a
    drafted step costs 1.6 plain ones: drafting pays) and bucket 32 (4.35: it loses), a bucket's cost is
    interpolated in log2 of the batch; where that settles the choice clearly, the bucket skips measuring."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 6, t_draft=0.16, tokens=2.0, t_plain=0.10)
    drive(p, 32, 2, t_draft=0.435, tokens=2.0, t_plain=0.10)
    assert p.buckets[1].drafting is True and p.buckets[32].drafting is False
    assert p.next_step(12) is StepKind.PLAIN  # bucket 16: 1.6 + 4/5 x 2.75 = 3.8 plain steps, gain 0.53
    assert p.next_step(8) is StepKind.PLAIN  # bucket 8: 3.25, gain 0.62
    prior = p.buckets[8].prior
    assert prior.sources == (1, 32) and prior.ratio == pytest.approx(1.6 + 3 / 5 * 2.75) and not prior.drafting
    assert prior.interval == p.buckets[32].interval
    assert p.next_step(4) is StepKind.PLAIN  # bucket 4: 2.7, gain 0.74: just outside the band (0.79)
    # Bucket 2: 2.15, gain 0.93 is within clear_band of the threshold: it measures, drafting first.
    assert p.next_step(2) is StepKind.DRAFTED and p.buckets[2].drafting is None and p.buckets[2].prior is None


def test_drafting_goes_off_as_soon_as_the_gain_falls_below_the_margin():
    """No hysteresis: the timed forwards leave out costs of drafted steps, so a gain just under 1 + margin is off."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 20, t_draft=0.10, tokens=2.0, t_plain=0.10)
    assert p.buckets[1].drafting is True
    drive(p, 1, 200, t_draft=0.10, tokens=1.03, t_plain=0.10)  # gain 1.03: below the margin, above 1
    assert p.buckets[1].drafting is False and 1.0 < p.gain(1) < 1.0 + CFG.margin


def test_probes_keep_their_pace_while_the_gain_is_within_its_error_of_the_threshold():
    """A noisy draft near break-even (tokens 1, 2, 1, 2, ...: gain 1.0 +- its error) keeps being probed every
    probe_interval; the same mean without noise is clearly below 1.05 and backs off to the bound."""
    noisy, steady = AdaptiveSpeculation(CFG), AdaptiveSpeculation(CFG)
    for _ in range(300):
        for p, tokens in ((noisy, 1.0 + noisy.accept.count % 2), (steady, 1.5)):
            step(p, 1, 0.15, tokens, 0.10)
    assert noisy.buckets[1].drafting is False and steady.buckets[1].drafting is False
    assert noisy.buckets[1].interval == CFG.probe_interval
    assert steady.buckets[1].interval == CFG.max_probe_interval


def test_above_batch_one_a_losing_probe_always_doubles_the_interval():
    """Bigger buckets' timed gain reads high near the threshold (costs outside the forward), so there the noisy
    draft of the test above backs off like a steady one."""
    p = AdaptiveSpeculation(CFG)
    for i in range(300):
        step(p, 2, 0.15, 1.0 + i % 2, 0.10)
    assert p.buckets[2].drafting is False and p.buckets[2].interval == CFG.max_probe_interval


@pytest.mark.parametrize("gain, drafts", [(1.04, False), (1.06, True)])
def test_the_draft_must_beat_plain_by_the_margin(gain, drafts):
    p = AdaptiveSpeculation(CFG)
    drive(p, 2, 30, t_draft=0.10, tokens=gain, t_plain=0.10)
    assert p.buckets[2].drafting is drafts


def test_warmup_median_ignores_a_cold_first_step():
    p = AdaptiveSpeculation(CFG)
    for s in (5.0, 0.11, 0.12):  # the first drafted step of a new shape is slow
        p.record(4, True, s, 2.0)
    for s in (0.10, 0.10, 0.10):
        p.record(4, False, s)
    assert p.buckets[4].t_draft == pytest.approx(0.12) and p.buckets[4].drafting is True


def test_same_timings_give_the_same_decisions():
    timings = [(0.15, 1.3, 0.10)] * 30 + [(0.15, 5.0, 0.10)] * 30 + [(0.2, 1.1, 0.1)] * 30
    runs = []
    for _ in range(2):
        p = AdaptiveSpeculation(CFG)
        runs.append([k for t in timings for k in drive(p, 3, 1, *t)])
    assert runs[0] == runs[1] and True in runs[0][6:] and False in runs[0][6:]


def test_probes_of_a_losing_draft_are_spaced_by_their_cost():
    """While drafting is off, the probe interval counts plain-step time: a drafted probe that costs 3 plain
    steps comes 3x less often than one that costs about as much as a plain step, so both spend the same share
    (both drafts lose by the same 1%, so their accept lengths fall equally short)."""
    cheap, costly = AdaptiveSpeculation(CFG), AdaptiveSpeculation(CFG)
    a = drive(cheap, 1, 400, t_draft=0.101, tokens=1.0, t_plain=0.10)[6:]
    b = drive(costly, 1, 400, t_draft=0.30, tokens=2.97, t_plain=0.10)[6:]
    assert cheap.buckets[1].drafting is False and costly.buckets[1].drafting is False
    # ceil(16 x 1.01 x 1.06) and ceil(16 x 3 x 1.06), + the probe
    assert gaps(a, True)[-3:] == [19, 19, 19] and gaps(b, True)[-3:] == [52, 52, 52]


def test_a_draft_further_from_paying_is_probed_less_often():
    """Drafting pays again only once the accept length reaches (1 + margin) x the cost ratio: a draft that needs
    it to double probes half as often as one just short of it."""
    near, far = AdaptiveSpeculation(CFG), AdaptiveSpeculation(CFG)
    a = drive(near, 1, 400, t_draft=0.30, tokens=3.0, t_plain=0.10)[6:]
    b = drive(far, 1, 400, t_draft=0.30, tokens=1.575, t_plain=0.10)[6:]
    assert near.buckets[1].drafting is False and far.buckets[1].drafting is False
    assert gaps(a, True)[-2:] == [52, 52] and gaps(b, True)[-2:] == [97, 97]  # ceil(16 x 3 x 1.05 x 3 / L), + 1


def test_drafting_off_reads_the_choice_without_changing_it():
    """The scheduler's mixed-chunk question: True only for a bucket that chose draft-free steps; asking
    neither creates a bucket nor counts toward a probe."""
    p = AdaptiveSpeculation(CFG)
    assert not p.drafting_off(1) and not p.buckets
    drive(p, 1, 3, t_draft=0.15, tokens=1.3, t_plain=0.10)
    assert not p.drafting_off(1)  # measuring
    drive(p, 1, 3, t_draft=0.15, tokens=1.3, t_plain=0.10)
    since = p.buckets[1].since_probe
    assert p.drafting_off(1) and p.drafting_off(1) and p.buckets[1].since_probe == since
    assert not p.drafting_off(2) and 2 not in p.buckets  # a bucket nobody decoded in has no choice yet
    q = AdaptiveSpeculation(CFG)
    drive(q, 1, 6, t_draft=0.15, tokens=3.0, t_plain=0.10)
    assert q.buckets[1].drafting is True and not q.drafting_off(1)


def test_a_draft_free_bucket_probes_with_shadow_steps_that_time_nothing():
    """Once a bucket has timed drafting and turned it off, its probes are shadow steps (the drafts scored against
    the target's own next tokens): the accept length is sampled for the price of the draft block, neither step-time
    EMA moves, and they come exactly where drafted probes would."""
    shadow, drafted = AdaptiveSpeculation(CFG), AdaptiveSpeculation(dataclasses.replace(CFG, shadow_probes=False))
    a = [step(shadow, 8, 0.45, 1.5, 0.15) for _ in range(250)]
    b = [step(drafted, 8, 0.45, 1.5, 0.15) for _ in range(250)]
    assert a[:6] == b[:6] == [StepKind.DRAFTED, StepKind.PLAIN] * 3  # measuring: drafted steps time drafting
    assert shadow.buckets[8].drafting is False and drafted.buckets[8].drafting is False
    probes = [i for i, k in enumerate(a) if i >= 6 and k is not StepKind.PLAIN]
    assert probes == [i for i, k in enumerate(b) if i >= 6 and k is not StepKind.PLAIN] and len(probes) >= 3
    assert all(a[i] is StepKind.SHADOW and b[i] is StepKind.DRAFTED for i in probes)
    bucket = shadow.buckets[8]
    assert bucket.t_draft == pytest.approx(0.45) and bucket.t_plain == pytest.approx(0.15)
    assert shadow.accept.count == 8 * (3 + len(probes))  # every shadow step's requests fed the estimate


def test_a_shadow_probe_that_finds_the_draft_paying_switches_it_on(caplog):
    """A reply turns repetitive while drafting is off: the shadow probes' scores lift the accept length until the
    bucket's own timings say drafting pays, and it switches on (probing plain steps again from the shortest interval)."""
    p = AdaptiveSpeculation(CFG)
    for _ in range(40):
        step(p, 8, 0.45, 1.5, 0.15)
    assert p.buckets[8].drafting is False
    caplog.set_level(logging.INFO, logger="sglite.srt.speculative.adaptive")
    kinds = []
    while p.buckets[8].drafting is False and len(kinds) < 600:
        kinds.append(step(p, 8, 0.45, 5.0, 0.15))  # 5 tokens in 3 plain steps' time
    assert p.buckets[8].drafting is True
    probes = [k for k in kinds if k is not StepKind.PLAIN]
    # Shadow probes lift the estimate; once the accept length nears paying, a drafted probe is the cheaper kind
    # (its loss, t_draft - L x t_plain, falls below the draft block's), and one of them switches drafting on.
    assert probes[0] is StepKind.SHADOW and probes.count(StepKind.DRAFTED) <= 2, probes
    assert p.buckets[8].interval == CFG.probe_interval and p.next_step(8) is StepKind.DRAFTED
    assert any("switched" in r.getMessage() and "drafting on" in r.getMessage() for r in caplog.records)

    # A batch of 32 fills the accept window in one step: one shadow probe that finds a repetitive reply switches.
    q = AdaptiveSpeculation(CFG)
    for _ in range(40):
        step(q, 32, 0.30, 1.5, 0.10)
    assert q.buckets[32].drafting is False
    kinds = [step(q, 32, 0.30, 5.0, 0.10) for _ in range(200)]  # gain 1.67: clear of the threshold at once
    first = next(i for i, k in enumerate(kinds) if k is not StepKind.PLAIN)
    assert kinds[first] is StepKind.SHADOW and q.buckets[32].drafting is True
    assert kinds[first + 1] is StepKind.DRAFTED
    assert any("switched (shadow probe): drafting on" in r.getMessage() for r in caplog.records)


def test_a_probe_is_the_cheaper_kind_beyond_plain_steps_committing_the_same_tokens():
    """A shadow step's price is the draft block (t_shadow - t_plain), a drafted one's t_draft - L x t_plain. At
    batch 8 on a CPU the verify loses ~1 plain step and the block costs ~0.2: shadow probes. At batch 1 near
    break-even the drafted step loses nothing and the block still costs ~0.27 plain steps: once a shadow step has
    been timed, drafted probes (which also keep timing drafting)."""
    far = AdaptiveSpeculation(CFG)
    kinds = [step(far, 8, 0.127, 1.8, 0.046, t_block=0.0104) for _ in range(400)]
    assert far.buckets[8].drafting is False
    probes = [k for k in kinds[6:] if k is not StepKind.PLAIN]
    assert len(probes) >= 3 and set(probes) == {StepKind.SHADOW}

    near = AdaptiveSpeculation(CFG)
    kinds = [step(near, 1, 0.0275, 1.55, 0.0172, t_block=0.0048) for _ in range(400)]
    b = near.buckets[1]
    assert b.drafting is False and b.t_shadow is None and len(b.shadow_warmup) == 1
    probes = [k for k in kinds[6:] if k is not StepKind.PLAIN]
    assert probes[0] is StepKind.SHADOW and set(probes[1:]) == {StepKind.DRAFTED} and len(probes) >= 4


def test_a_bucket_that_must_time_drafting_probes_with_drafted_steps():
    """Shadow steps do not time drafting, so a bucket whose verdict rests on no drafted step of its own (a choice
    from neighbours), or on one early step no longer clear at today's accept length, probes with a drafted step."""
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 60, t_draft=0.15, tokens=1.3, t_plain=0.10)
    kinds = [step(p, 8, 0.45, 1.3, 0.15) for _ in range(60)]  # bucket 8 starts off from bucket 1's bound
    assert p.buckets[8].prior is not None and StepKind.DRAFTED in kinds and StepKind.SHADOW not in kinds

    q = AdaptiveSpeculation(CFG)
    assert [step(q, 32, 0.435, 2.0, 0.10) for _ in range(2)] == [StepKind.DRAFTED, StepKind.PLAIN]
    b = q.buckets[32]
    assert b.drafting is False and not b.warm()  # off after one drafted step: gain 0.46, clear
    b.since_probe = 10**6  # the next step is a probe
    assert q.next_step(32) is StepKind.SHADOW
    q.accept.add(4.0, 10**6)  # the accept length doubled: gain 0.92, not clear from one drafted step
    assert q.next_step(32) is StepKind.DRAFTED


def test_a_calibrated_bucket_decides_from_the_accept_length_alone():
    p = AdaptiveSpeculation(CFG)
    p.calibrate(1, [0.15, 0.16, 0.14], [0.10, 0.30, 0.10])  # medians 0.15 and 0.10
    b = p.buckets[1]
    assert b.warm() and b.drafting is None and (b.t_draft, b.t_plain) == (0.15, 0.10)
    # No accept length yet: one drafted step samples it, and the warm bucket decides at once.
    assert step(p, 1, 0.15, 2.0, 0.10) is StepKind.DRAFTED
    assert b.drafting is True and p.gain(1) == pytest.approx(2.0 * 0.10 / 0.15)
    # A bucket calibrated once the accept length is known decides before its first step: no measuring steps.
    p.calibrate(2, [0.30], [0.10])
    assert p.buckets[2].drafting is False  # 2.0 tokens for 3 plain steps
    assert step(p, 2, 0.30, 2.0, 0.10) is StepKind.PLAIN
    assert not (p.buckets[2].draft_warmup or p.buckets[2].plain_warmup)


def test_a_calibrated_bucket_logs_its_first_choice_as_calibrated(caplog):
    caplog.set_level(logging.INFO, logger="sglite.srt.speculative.adaptive")
    p = AdaptiveSpeculation(CFG)
    p.calibrate(1, [0.15], [0.10])
    step(p, 1, 0.15, 2.0, 0.10)
    assert "batch bucket <= 1 calibrated: drafting on" in caplog.text and "measured" not in caplog.text
    drive(p, 2, 6, t_draft=0.30, tokens=2.0, t_plain=0.10)  # bucket 2 was not calibrated: it measures
    assert "batch bucket <= 2 measured: drafting off" in caplog.text


def test_a_gain_at_the_threshold_flips_often_and_only_switches_1_2_4_8_are_logged_at_info(caplog):
    """Bucket 1 of the default pair sits at the 1.05 threshold and flips at most probes; each flip is logged, but
    at INFO only a bucket's 1st, 2nd, 4th, 8th, ... switch, so a server's log is not one line per probe."""
    caplog.set_level(logging.DEBUG, logger="sglite.srt.speculative.adaptive")
    p = AdaptiveSpeculation(CFG)
    rng = random.Random(0)
    for _ in range(3000):  # step times jitter by +-4% around a gain of exactly 1.05
        step(p, 1, 0.15 * rng.uniform(0.96, 1.04), 1.575, 0.10 * rng.uniform(0.96, 1.04))
    switches = p.buckets[1].switches
    assert switches >= 20
    logged = [(int(r.getMessage().split("; switch ")[1]), r.levelno) for r in caplog.records if "; switch " in r.getMessage()]
    assert [n for n, _ in logged] == list(range(1, switches + 1))  # every flip is logged, in order
    assert [n for n, level in logged if level == logging.INFO] == [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= switches]
    assert all(level == logging.DEBUG for n, level in logged if n & (n - 1))


def test_a_bucket_whose_drafted_step_outcosts_a_full_verify_never_drafts_and_only_re_times_it(caplog):
    caplog.set_level(logging.INFO, logger="sglite.srt.speculative.adaptive")
    p = AdaptiveSpeculation(CFG, max_tokens_per_step=3)
    p.calibrate(8, [0.31] * 3, [0.10] * 3)  # 3.1 plain steps: 3 tokens a request at most give 0.97x
    b = p.buckets[8]
    assert b.drafting is False and b.interval == CFG.max_probe_interval and p.tokens is None
    assert "can never pay" in caplog.text
    kinds = [step(p, 8, 0.31, 2.0, 0.10) for _ in range(400)]
    # No measuring and no shadow steps: the probes are drafted ones (they re-time the step), as rare as the policy
    # spaces the longest interval: 16 x 3.1 plain steps, then stretched by the accept length's shortfall.
    assert StepKind.SHADOW not in kinds
    at = [i for i, k in enumerate(kinds) if k is StepKind.DRAFTED]
    assert at[0] == math.ceil(CFG.max_probe_interval * 3.1)
    assert gaps(kinds, StepKind.DRAFTED)[0] == 1 + math.ceil(CFG.max_probe_interval * 3.1 * 1.05 * 3.1 / 2.0)
    # Cheaper drafting (2.5 plain steps) is not ruled out: its gain depends on the accept length.
    q = AdaptiveSpeculation(CFG, max_tokens_per_step=3)
    q.calibrate(8, [0.25], [0.10])
    assert q.buckets[8].drafting is None and q.next_step(8) is StepKind.DRAFTED


def test_a_bucket_above_one_that_can_never_pay_starts_off_before_any_drafted_step():
    p = AdaptiveSpeculation(CFG, max_tokens_per_step=3)
    p.calibrate(8, [0.31], [0.10])
    assert p.next_step(32) is StepKind.PLAIN
    prior = p.buckets[32].prior
    assert prior is not None and prior.sources == (8,) and prior.drafting is False
    assert p.buckets[32].interval == CFG.max_probe_interval
    assert p.next_step(4) is StepKind.DRAFTED  # below it, only an upper bound: bucket 4 measures


def test_a_bucket_timed_live_that_can_never_pay_probes_at_the_longest_interval():
    for w, interval in ((3, CFG.max_probe_interval), (None, 2 * CFG.probe_interval)):
        p = AdaptiveSpeculation(CFG, max_tokens_per_step=w)
        drive(p, 8, 6, t_draft=0.31, tokens=2.0, t_plain=0.10)  # warm-up: both kinds, then off
        b = p.buckets[8]
        assert b.warm() and b.drafting is False
        b.since_probe = 10**6
        assert step(p, 8, 0.31, 2.0, 0.10) is (StepKind.DRAFTED if w else StepKind.SHADOW)
        assert b.interval == interval, w


def test_calibration_input_is_checked():
    p = AdaptiveSpeculation(CFG)
    with pytest.raises(ValueError, match="at least one drafted and one draft-free"):
        p.calibrate(1, [], [0.1])
    with pytest.raises(ValueError, match="step seconds"):
        p.calibrate(1, [0.1], [0.0])
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        AdaptiveSpeculation(CFG, max_tokens_per_step=0)
    with pytest.raises(ValueError, match="calibrate_max_batch_size"):
        AdaptiveSpecConfig(calibrate_max_batch_size=-1)


# Traffic in phases: a batch size between 1 and 64, an accept length (1 to 5 tokens per request) and a length in
# steps. A drafted step costs more plain steps the bigger the batch (1.45 at 1, ~11 at 64); step times jitter.
TRAFFIC = st.lists(st.tuples(st.integers(1, 64), st.floats(1.0, 5.0), st.integers(1, 80)), min_size=1, max_size=12)


def replay(phases, seed, calibrated):
    """Feed the traffic through a fresh policy (a 5-token verify; buckets up to ``calibrated`` timed first); check
    the invariants after every step; return its choices."""
    rng = random.Random(seed)
    p = AdaptiveSpeculation(CFG, max_tokens_per_step=5)

    def times(bs):
        t_plain = (0.04 + 0.002 * bs) * rng.uniform(0.9, 1.1)
        return t_plain * (1.3 + 0.15 * bs), t_plain

    for k in (1, 2, 4, 8, 16, 32, 64):
        if k <= calibrated:
            t_draft, t_plain = times(k)
            p.calibrate(k, [t_draft], [t_plain])
    threshold = 1.0 + CFG.margin
    kinds = []
    for bs, tokens, n in phases:
        for _ in range(n):
            t_draft, t_plain = times(bs)
            kinds.append(step(p, bs, t_draft, tokens, t_plain))
            b = p.buckets[bucket_of(bs)]
            if b.warm() and p.tokens is not None:  # a warm bucket's choice is its own timings' verdict
                assert b.drafting == (p.gain(bs) >= threshold) and b.prior is None
            if b.warm() and p.tokens is None:  # before any accept length, only its cost can have ruled it out
                assert b.drafting is (False if p._never_pays(b) else None)
            if b.prior is not None:  # a choice taken from neighbours names timed, decided buckets
                assert all(src in p.buckets and p.buckets[src].drafting is not None for src in b.prior.sources)
                assert b.prior.ratio > 0.0 and bucket_of(bs) not in b.prior.sources
            assert all(p._probe_gap(other) >= 1 for other in p.buckets.values())
    return kinds


@settings(max_examples=100, deadline=None)
@given(TRAFFIC, st.integers(0, 2**16), st.sampled_from([0, 1, 8, 64]))
def test_on_any_traffic_the_policy_keeps_its_invariants_and_is_deterministic(phases, seed, calibrated):
    assert replay(phases, seed, calibrated) == replay(phases, seed, calibrated)


def test_bad_input_is_a_clear_error():
    p = AdaptiveSpeculation(CFG)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step seconds"):
            p.record(1, False, seconds)
    with pytest.raises(ValueError, match="token per request"):
        p.record(1, True, 0.1, 0.5)
    with pytest.raises(ValueError, match="probes a draft-free bucket"):
        p.record_shadow(1, 0.1)  # bucket 1 is measuring
    with pytest.raises(ValueError, match="step seconds"):
        p.record_shadow(1, 0.0)
    with pytest.raises(ValueError, match=">= 1 request"):
        p.record_shadow_accept(1, 2.0, 0)
    with pytest.raises(ValueError, match="token per request"):
        p.record_shadow_accept(1, 0.5, 1)
    for kw, match in (
        (dict(ema_alpha=0.0), "ema_alpha"),
        (dict(warmup_steps=0), "warmup_steps"),
        (dict(clear_band=1.0), "clear_band"),
        (dict(accept_window=0), "accept_window"),
        (dict(uncertain_probe_max_batch=-1), "uncertain_probe_max_batch"),
        (dict(z=float("nan")), "z must"),
        (dict(margin=-0.1), "margin"),
        (dict(probe_interval=32, max_probe_interval=16), "probe_interval"),
    ):
        with pytest.raises(ValueError, match=match):
            AdaptiveSpecConfig(**kw)


def test_a_bucket_settled_by_a_neighbour_before_any_accept_length_logs_without_error(caplog):
    """A neighbour that can never pay settles a new bucket before any drafted step: the start line says so."""
    caplog.set_level(logging.INFO, logger="sglite.srt.speculative.adaptive")
    p = AdaptiveSpeculation(CFG, max_tokens_per_step=3)
    p.calibrate(8, [0.31] * 3, [0.10] * 3)
    assert p.tokens is None
    p.next_step(16)
    assert p.buckets[16].drafting is False
    assert "batch bucket <= 16 starts with drafting off" in caplog.text and "accept len not measured yet" in caplog.text
