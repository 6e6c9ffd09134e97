"""AdaptiveSpeculation, the measured cost model of --speculative-adaptive, fed synthetic step timings."""

import pytest

from sglite.srt.speculative.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation, bucket_of

SUITE = "unit-cpu"
EST_TIME = 1

CFG = AdaptiveSpecConfig(ema_alpha=0.25, warmup_steps=3, margin=0.05, probe_interval=4, max_probe_interval=16)


def drive(policy, bs, steps, t_draft, tokens, t_plain):
    """Run `steps` decode steps whose drafted/plain costs are fixed; return the drafted? of each."""
    kinds = []
    for _ in range(steps):
        drafted = policy.should_draft(bs)
        policy.record(bs, drafted, t_draft if drafted else t_plain, tokens if drafted else 1.0)
        kinds.append(drafted)
    return kinds


def gaps(kinds, value):
    """Positions of `value` in kinds, as distances between consecutive ones."""
    at = [i for i, k in enumerate(kinds) if k == value]
    return [b - a for a, b in zip(at, at[1:])]


def test_warmup_drafts_then_goes_plain_then_decides():
    p = AdaptiveSpeculation(CFG)
    kinds = drive(p, 1, 6, t_draft=0.15, tokens=1.3, t_plain=0.10)
    assert kinds == [True, True, True, False, False, False]
    b = p.buckets[1]
    assert b.drafting is False and b.gain() == pytest.approx(1.3 * 0.10 / 0.15)


def test_a_losing_draft_is_turned_off_and_probed_ever_less_often_up_to_the_bound():
    p = AdaptiveSpeculation(CFG)
    kinds = drive(p, 1, 200, t_draft=0.15, tokens=1.3, t_plain=0.10)[6:]
    # Off after warm-up; each probe (one drafted step) loses, doubling the gap: 4, 8, 16, then 16 (the bound).
    assert kinds.count(True) < len(kinds) // 10
    assert gaps(kinds, True)[:5] == [9, 17, 17, 17, 17]  # steps on the chosen path + the probe itself
    assert kinds[:5] == [False, False, False, False, True]
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
    assert kinds.index(True) == len(kinds) - 1 <= CFG.max_probe_interval  # the first probe switched it on
    assert p.buckets[1].interval == CFG.probe_interval  # reset on the switch
    assert all(drive(p, 1, CFG.probe_interval, t_draft=0.15, tokens=6.0, t_plain=0.10))
    # ... and off again once acceptance falls back.
    drive(p, 1, 40, t_draft=0.15, tokens=1.0, t_plain=0.10)
    assert p.buckets[1].drafting is False


def test_buckets_are_powers_of_two_and_decide_independently():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="batch size"):
        bucket_of(0)
    p = AdaptiveSpeculation(CFG)
    drive(p, 1, 20, t_draft=0.12, tokens=2.0, t_plain=0.10)  # small batches: the draft wins
    drive(p, 5, 10, t_draft=0.50, tokens=1.5, t_plain=0.20)  # bucket 8: it loses
    drive(p, 8, 10, t_draft=0.50, tokens=1.5, t_plain=0.20)  # same bucket as 5
    assert sorted(p.buckets) == [1, 8]
    assert p.buckets[1].drafting is True and p.buckets[8].drafting is False
    assert p.should_draft(1) and p.should_draft(3)  # bucket 4 is new: it measures, drafting first
    assert p.buckets[4].drafting is None


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


def test_bad_input_is_a_clear_error():
    p = AdaptiveSpeculation(CFG)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step seconds"):
            p.record(1, False, seconds)
    with pytest.raises(ValueError, match="token per request"):
        p.record(1, True, 0.1, 0.5)
    for kw, match in (
        (dict(ema_alpha=0.0), "ema_alpha"),
        (dict(warmup_steps=0), "warmup_steps"),
        (dict(margin=-0.1), "margin"),
        (dict(probe_interval=32, max_probe_interval=16), "probe_interval"),
    ):
        with pytest.raises(ValueError, match=match):
            AdaptiveSpecConfig(**kw)
