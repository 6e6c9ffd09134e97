"""AcceptEstimate: the accept length counted per request, a running mean that turns into an EMA, and its error."""

import math

import pytest

from sglite.srt.speculative.accept_estimate import AcceptEstimate

SUITE = "unit-cpu"
EST_TIME = 1


def test_the_accept_estimate_is_a_running_mean_then_an_ema():
    est = AcceptEstimate(window=4)
    for x in (1.0, 3.0, 2.0, 2.0):
        est.add(x)
    assert est.mean == pytest.approx(2.0) and est.var_per_request == pytest.approx(0.5)  # exact: population variance
    assert est.stderr() == pytest.approx(math.sqrt(0.5 / 4))
    est.add(6.0)  # now an EMA of weight 1/4
    assert est.mean == pytest.approx(2.0 + (6.0 - 2.0) / 4)
    assert est.var_per_request == pytest.approx(0.75 * (0.5 + 0.25 * 16.0))
    assert est.stderr() == pytest.approx(math.sqrt(est.var_per_request / 5))
    for _ in range(100):
        est.add(6.0)
    assert est.stderr() == pytest.approx(math.sqrt(est.var_per_request / 7))  # (2 - a) / a samples at most


def test_the_accept_estimate_counts_requests():
    """A batch-8 step observes 8 acceptances: it weighs 8 in the running mean and moves the EMA 8/window; its
    mean varies sqrt(8) less than one request's tokens, so the spread is kept per request."""
    est = AcceptEstimate(window=32)
    est.add(2.0, 1)
    est.add(1.0, 3)
    assert est.count == 4 and est.mean == pytest.approx((2.0 + 3 * 1.0) / 4)
    full = AcceptEstimate(window=32)
    for _ in range(40):
        full.add(2.0, 1)
    full.add(4.0, 8)
    assert full.mean == pytest.approx(2.0 + 8 / 32 * 2.0)
    one, eight = AcceptEstimate(window=32), AcceptEstimate(window=32)
    for i in range(200):  # the same per-request spread (+-1) seen one request or eight at a time
        one.add(2.0 + (1.0 if i % 2 else -1.0), 1)
        eight.add(2.0 + (1.0 if i % 2 else -1.0) / math.sqrt(8), 8)
    assert eight.var_per_request == pytest.approx(one.var_per_request, rel=0.3)
    assert eight.stderr() == pytest.approx(one.stderr(), rel=0.3)  # both average ~63 requests
