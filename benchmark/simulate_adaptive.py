#!/usr/bin/env python3
"""The --speculative-adaptive policy alone, on synthetic traffic: share of steps drafted and speed vs plain.

No model runs: ``AdaptiveSpeculation`` is fed step times and per-request committed tokens drawn (seeded) from
a list, so a policy change can be judged in seconds before it is A/B'd on a real server. Two tables:

- batch 1, fixed step times: each case prints the true gain of always drafting, and the policy's mean over seeds;
- traffic: ``bench_spec``'s shape (a 1-request warm-up, then requests of up to 64 tokens at a concurrency, most
  running to the limit), with step times that grow with the batch as measured on the default pair (compiled,
  2-core CPU, session 12): a drafted step costs 1.6 plain steps at batch 1 and 4.3 at batch 32, so the
  batch-size buckets a wave falls through each decide for themselves.

    python benchmark/simulate_adaptive.py                      # the shipped AdaptiveSpecConfig
    python benchmark/simulate_adaptive.py --accept-window 16 --z 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from sglite.srt.speculative.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation  # noqa: E402

# name -> phases of (per-step tokens to draw from, steps); "mixed" changes regime mid-run
CASES: dict[str, list[tuple[list[int], int]]] = {
    "pays (1.48x)": [([1, 1, 1, 2, 2, 3, 4, 5], 1000)],
    "marginal (1.17x)": [([1, 1, 1, 1, 2, 2, 3, 4], 1000)],
    "loses (0.83x)": [([1, 1, 1, 1, 2, 2], 1000)],
    "mixed": [([1, 1, 1, 1, 2, 2, 3, 4], 300), ([5], 300), ([1, 1, 1, 1, 2, 2], 300), ([4, 5, 5], 200)],
}


@dataclasses.dataclass
class SimResult:
    """One seeded run: share of steps drafted and throughput relative to never drafting."""

    drafted_share: float
    speed_vs_plain: float


def simulate(config: AdaptiveSpecConfig, phases: list[tuple[list[int], int]], seed: int,
             t_draft: float, t_plain: float) -> SimResult:
    """Run the policy over the phases at batch 1."""
    rng = random.Random(seed)
    policy = AdaptiveSpeculation(config)
    steps = drafted = 0
    seconds = tokens = 0.0
    for choices, n in phases:
        for _ in range(n):
            if policy.should_draft(1):
                k = rng.choice(choices)
                policy.record(1, True, t_draft, float(k))
                drafted += 1
                seconds += t_draft
                tokens += k
            else:
                policy.record(1, False, t_plain)
                seconds += t_plain
                tokens += 1
            steps += 1
    return SimResult(drafted / steps, tokens / seconds * t_plain)


# Seconds of a decode step of b requests on the default pair (compiled, 2-core CPU; session 12's server log:
# batch 1 0.0436 / 0.0694 s, batch 32 0.1147 / 0.4988 s). A drafted step verifies W = 5 tokens a request, so its
# GEMMs have about 5b rows: it costs about a plain step of 5b requests plus the draft block.
def plain_step_seconds(b: int) -> float:
    """A plain decode step of b requests."""
    return 0.0413 + 0.0023 * b


def drafted_step_seconds(b: int) -> float:
    """A drafted decode step (draft block + verify of 5 tokens a request) of b requests."""
    return 0.0557 + 0.0138 * b


# name -> (requests, concurrency); each request's committed tokens per drafted step are drawn from TRAFFIC_ACCEPT
TRAFFIC: dict[str, tuple[int, int]] = {
    "conc 1, 8 requests": (8, 1),
    "conc 8, 32 requests": (32, 8),
    "conc 32, one wave": (32, 32),
}
TRAFFIC_ACCEPT = [1, 1, 1, 2, 2, 2, 3, 4]  # mean 2.0 (the default draft: ~1.8-2.1 on held-out chat)


def _run_waves(lengths: list[int], concurrency: int, step) -> None:
    """Decode the warm-up request alone, then the rest at the concurrency (a finished request is replaced at once).

    ``step(running)`` runs one decode step over the requests' tokens left and returns the tokens each committed.
    """
    for wave, conc in (([lengths[0]], 1), (lengths[1:], concurrency)):
        waiting, running = list(wave), []
        while waiting or running:
            while waiting and len(running) < conc:
                running.append(waiting.pop(0))
            commits = step(running)
            running = [left - c for left, c in zip(running, commits) if left > c]


def simulate_traffic(config: AdaptiveSpecConfig, num_requests: int, concurrency: int, seed: int,
                     max_new_tokens: int = 64) -> SimResult:
    """A warm-up request, then num_requests at a concurrency, all decode steps, against never drafting.

    A request runs to max_new_tokens, or (one in four) stops early at a seeded length; the time of the same token
    counts never drafting is the baseline. Prefill is left out (both paths pay it alike).
    """
    rng = random.Random(seed)
    policy = AdaptiveSpeculation(config)
    lengths = [max_new_tokens if rng.random() < 0.75 else rng.randint(8, max_new_tokens - 1)
               for _ in range(num_requests + 1)]
    kinds: list[bool] = []  # the policy's steps: drafted or not
    seconds = [0.0, 0.0]  # the policy's, never drafting's

    def policy_step(running: list[int]) -> list[int]:
        b = len(running)
        drafted = policy.should_draft(b)
        if drafted:
            commits = [min(left, rng.choice(TRAFFIC_ACCEPT)) for left in running]
            t = drafted_step_seconds(b)
            policy.record(b, True, t, sum(commits) / b)
        else:
            commits = [1] * b
            t = plain_step_seconds(b)
            policy.record(b, False, t)
        kinds.append(drafted)
        seconds[0] += t
        return commits

    def plain_step(running: list[int]) -> list[int]:
        seconds[1] += plain_step_seconds(len(running))
        return [1] * len(running)

    _run_waves(lengths, concurrency, policy_step)
    _run_waves(lengths, concurrency, plain_step)
    return SimResult(sum(kinds) / len(kinds), seconds[1] / seconds[0])


def main() -> None:
    """Print one row per case."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = AdaptiveSpecConfig()
    p.add_argument("--accept-window", type=int, default=defaults.accept_window)
    p.add_argument("--z", type=float, default=defaults.z)
    p.add_argument("--margin", type=float, default=defaults.margin)
    p.add_argument("--t-draft", type=float, default=0.16, help="seconds of a drafted step (1.6 plain steps: this CPU)")
    p.add_argument("--t-plain", type=float, default=0.10)
    p.add_argument("--seeds", type=int, default=40)
    args = p.parse_args()
    config = dataclasses.replace(defaults, accept_window=args.accept_window, z=args.z, margin=args.margin)
    print(f"{config}\nt_draft {args.t_draft} s, t_plain {args.t_plain} s, {args.seeds} seeds")
    print(f"{'case':>18} {'always drafting':>16} {'policy':>8} {'drafted':>8}")
    for name, phases in CASES.items():
        always = sum(sum(c) / len(c) * n for c, n in phases) / sum(n * args.t_draft for _, n in phases) * args.t_plain
        runs = [simulate(config, phases, s, args.t_draft, args.t_plain) for s in range(args.seeds)]
        speed = sum(r.speed_vs_plain for r in runs) / len(runs)
        share = sum(r.drafted_share for r in runs) / len(runs)
        print(f"{name:>18} {always:>15.2f}x {speed:>7.3f}x {100 * share:>7.0f}%")
    print(f"\ntraffic: up to 64 tokens a request, accept {TRAFFIC_ACCEPT}, {args.seeds} seeds")
    print(f"{'case':>22} {'policy':>8} {'drafted':>8}")
    for name, (n, conc) in TRAFFIC.items():
        runs = [simulate_traffic(config, n, conc, s) for s in range(args.seeds)]
        speed = sum(r.speed_vs_plain for r in runs) / len(runs)
        share = sum(r.drafted_share for r in runs) / len(runs)
        print(f"{name:>22} {speed:>7.3f}x {100 * share:>7.0f}%")


if __name__ == "__main__":
    main()
