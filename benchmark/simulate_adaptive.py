#!/usr/bin/env python3
"""The --speculative-adaptive policy alone, on synthetic traffic: share of steps drafted and speed vs plain.

No model runs: ``AdaptiveSpeculation`` is fed fixed step times (drafted / plain) and per-step committed tokens
drawn (seeded) from a list, so a policy change can be judged in seconds before it is A/B'd on a real server.
Each case prints the true gain of always drafting, and the policy's mean over seeds.

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


if __name__ == "__main__":
    main()
