"""simulate_adaptive: the shipped --speculative-adaptive policy on synthetic traffic keeps most of a paying
draft's gain, stays near plain speed with a losing one, and keeps part of a marginal one's."""

import os

import pytest

from sglite.srt.speculative.adaptive import AdaptiveSpecConfig
from sglite.testing.scripts import load_script

SUITE = "unit-cpu"
EST_TIME = 3

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


@pytest.fixture(scope="module")
def sim():
    return load_script(os.path.join(REPO, "benchmark", "simulate_adaptive.py"))


def mean_run(sim, case, seeds=8):
    runs = [sim.simulate(AdaptiveSpecConfig(), sim.CASES[case], s, t_draft=0.16, t_plain=0.10) for s in range(seeds)]
    return sum(r.speed_vs_plain for r in runs) / seeds, sum(r.drafted_share for r in runs) / seeds


def test_a_paying_draft_keeps_most_of_its_gain(sim):
    speed, share = mean_run(sim, "pays (1.48x)")
    assert speed > 1.4 and share > 0.9


def test_a_losing_draft_costs_little(sim):
    speed, share = mean_run(sim, "loses (0.83x)")
    assert speed > 0.98 and share < 0.05


def test_a_marginal_draft_keeps_part_of_its_gain(sim):
    # The policy before session 11 (an EMA of weight 0.25, doubling after every losing probe) drafted 4% here
    # and was 1.01x plain.
    speed, share = mean_run(sim, "marginal (1.17x)")
    assert speed > 1.05 and share > 0.3
