#!/usr/bin/env python3
"""The --speculative-adaptive policy alone, on synthetic traffic: share of steps drafted and speed vs plain.

No model runs: ``AdaptiveSpeculation`` is fed step times and per-request committed tokens drawn (seeded) from
a list, so a policy change can be judged in seconds before it is A/B'd on a real server. Two tables:

- batch 1, fixed step times: each case prints the true gain of always drafting, and the policy's mean over seeds;
- traffic: ``bench_spec``'s shape (a 1-request warm-up, then requests of up to 64 tokens at a concurrency, most
  running to the limit), with step times that grow with the batch as measured on the default pair (compiled,
  2-core AMD EPYC CPU, a 3-token verify, the Q8_0 draft): a drafted step costs 1.5 plain steps at batch 1, 2.9
  at batch 8 and ~3.6 at batch 32, so the batch-size buckets a wave falls through each decide for themselves.
  Buckets up to 32 start calibrated (the server's start-up timing) unless ``--no-calibration``.

A probe of a draft-free bucket is a shadow step (plain step + draft block, its drafts scored at once here) unless
``--no-shadow-probes`` (every probe a drafted step).

    python benchmark/simulate_adaptive.py                      # the shipped AdaptiveSpecConfig
    python benchmark/simulate_adaptive.py --accept-window 16 --z 2
    python benchmark/simulate_adaptive.py --no-shadow-probes
    python benchmark/simulate_adaptive.py --no-calibration
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from sglite.srt.speculative.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation, StepKind  # noqa: E402
from sglite.srt.speculative.step_calibration import calibration_batch_sizes  # noqa: E402

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


def run_step(policy: AdaptiveSpeculation, b: int, commits: list[int], t_draft: float, t_plain: float,
             t_block: float) -> tuple[bool, float, list[int]]:
    """One decode step of b requests as the policy plans it: (drafted?, seconds, tokens each request commits).

    ``commits`` are what a verify would commit per request this step; a shadow step commits one token each and
    reports ``commits`` as its scored drafts (here at once; the worker scores them a step or two later).
    """
    kind = policy.next_step(b)
    if kind is StepKind.DRAFTED:
        policy.record(b, True, t_draft, sum(commits) / b)
        return True, t_draft, commits
    if kind is StepKind.SHADOW:
        policy.record_shadow(b, t_plain + t_block)
        policy.record_shadow_accept(b, sum(commits) / b, b)
        return False, t_plain + t_block, [1] * b
    policy.record(b, False, t_plain)
    return False, t_plain, [1] * b


def simulate(config: AdaptiveSpecConfig, phases: list[tuple[list[int], int]], seed: int,
             t_draft: float, t_plain: float, t_block: float = 0.027) -> SimResult:
    """Run the policy over the phases at batch 1."""
    rng = random.Random(seed)
    policy = AdaptiveSpeculation(config)
    steps = drafted = 0
    seconds = tokens = 0.0
    for choices, n in phases:
        for _ in range(n):
            was_drafted, t, commits = run_step(policy, 1, [rng.choice(choices)], t_draft, t_plain, t_block)
            drafted += was_drafted
            seconds += t
            tokens += commits[0]
            steps += 1
    return SimResult(drafted / steps, tokens / seconds * t_plain)


# Seconds of a decode step of b requests on the default pair (compiled, 2-core CPU, a 3-token verify, the draft's
# linears as Q8_0 blocks; from the server's logs: batch 1 0.0185 / 0.029 s, batch 8 ~0.040 / ~0.116 s; the draft
# block 0.0030 s at batch 1). A drafted step verifies W = 3 tokens a request, so its GEMMs have about 3b rows.
VERIFY_WIDTH = 3
SERVER_MAX_RUNNING_REQUESTS = 64  # what the calibrated buckets stop at (with calibrate_max_batch_size)


def plain_step_seconds(b: int) -> float:
    """A plain decode step of b requests."""
    return 0.0155 + 0.003 * b


def drafted_step_seconds(b: int) -> float:
    """A drafted decode step (draft block + verify of 3 tokens a request) of b requests."""
    return 0.0166 + 0.0124 * b


def draft_block_seconds(b: int) -> float:
    """The draft block alone (what a shadow step adds to a plain one) for b requests."""
    return 0.003 + 0.0006 * b


# name -> (requests, concurrency); each request's committed tokens per drafted step are drawn from TRAFFIC_ACCEPT
TRAFFIC: dict[str, tuple[int, int]] = {
    "conc 1, 8 requests": (8, 1),
    "conc 8, 32 requests": (32, 8),
    "conc 32, one wave": (32, 32),
}
TRAFFIC_ACCEPT = [1, 1, 1, 2, 2, 3]  # mean 1.67 (the default draft, 3-token verify: 1.6-1.8 on held-out chat)


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
                     max_new_tokens: int = 64, accept: list[int] = TRAFFIC_ACCEPT) -> SimResult:
    """A warm-up request, then num_requests at a concurrency, all decode steps, against never drafting; each
    request's verify would commit a token count drawn from ``accept``.

    A request runs to max_new_tokens, or (one in four) stops early at a seeded length; the time of the same token
    counts never drafting is the baseline. Prefill is left out (both paths pay it alike), and so is the start-up
    calibration (before the server serves): its buckets start with the step costs at their timed batch sizes.
    """
    rng = random.Random(seed)
    policy = AdaptiveSpeculation(config, max_tokens_per_step=VERIFY_WIDTH)
    for b in calibration_batch_sizes(SERVER_MAX_RUNNING_REQUESTS, config.calibrate_max_batch_size):
        policy.calibrate(b, [drafted_step_seconds(b)], [plain_step_seconds(b)])
    lengths = [max_new_tokens if rng.random() < 0.75 else rng.randint(8, max_new_tokens - 1)
               for _ in range(num_requests + 1)]
    kinds: list[bool] = []  # the policy's steps: drafted or not
    seconds = [0.0, 0.0]  # the policy's, never drafting's

    def policy_step(running: list[int]) -> list[int]:
        b = len(running)
        verify_commits = [min(left, rng.choice(accept)) for left in running]
        drafted, t, commits = run_step(
            policy, b, verify_commits, drafted_step_seconds(b), plain_step_seconds(b), draft_block_seconds(b)
        )
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
    p.add_argument("--t-block", type=float, default=0.027, help="seconds of the draft block alone (a shadow step's extra)")
    p.add_argument("--no-shadow-probes", action="store_true", help="probe a draft-free bucket with drafted steps")
    p.add_argument("--no-calibration", action="store_true",
                   help="traffic: no start-up calibration, every bucket measures live")
    p.add_argument("--seeds", type=int, default=40)
    args = p.parse_args()
    config = dataclasses.replace(defaults, accept_window=args.accept_window, z=args.z, margin=args.margin,
                                 shadow_probes=not args.no_shadow_probes,
                                 calibrate_max_batch_size=0 if args.no_calibration else defaults.calibrate_max_batch_size)
    print(f"{config}\nt_draft {args.t_draft} s, t_plain {args.t_plain} s, t_block {args.t_block} s, {args.seeds} seeds")
    print(f"{'case':>18} {'always drafting':>16} {'policy':>8} {'drafted':>8}")
    for name, phases in CASES.items():
        always = sum(sum(c) / len(c) * n for c, n in phases) / sum(n * args.t_draft for _, n in phases) * args.t_plain
        runs = [simulate(config, phases, s, args.t_draft, args.t_plain, args.t_block) for s in range(args.seeds)]
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
