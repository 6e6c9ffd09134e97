"""Shadow probes: a draft-free bucket's cheap look at the accept length (``--speculative-adaptive``).

A shadow step runs the draft block, then the target decodes alone (``DFlashWorker._decode_shadow``). Its drafts are
kept here until the request's next tokens are out, then scored by what a verify of them would have committed, and
the mean goes to the cost model (``AdaptiveSpeculation.record_shadow_accept``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from sglite.srt.managers.schedule_batch import Req

# Decode steps a shadow probe waits for its requests' next tokens (a retracted request may not produce them soon);
# requests still unscored then are left out of its sample.
SHADOW_PROBE_MAX_AGE_STEPS = 16


def shadow_committed_tokens(drafts: Sequence[int], produced: Sequence[int], done: bool) -> Optional[int]:
    """Tokens a verify of ``drafts`` would have committed, judged by the tokens the target went on to produce
    without it; None while that needs tokens not produced yet.

    A verify commits the drafts' longest prefix equal to the target's own tokens and one more (the bonus), but
    never past where the request stopped (``done``: ``produced`` is all there will be). Greedy, this is exactly
    what the verify finds (its rows score as decode rows do); sampled, the drafts are point masses, so each is
    accepted with the target's probability of sampling it, which is what matching a sampled token measures.
    """
    matched = 0
    for draft, token in zip(drafts, produced):
        if draft != token:
            return matched + 1
        matched += 1
    if matched == len(drafts):
        return matched + 1 if not done or len(produced) > matched else matched
    return max(1, matched) if done else None


@dataclass
class ShadowProbe:
    """A shadow step's drafts, waiting to be scored against the tokens the target produces after it."""

    batch_size: int  # the step's: its bucket judges the result
    reqs: list[Req]
    starts: list[int]  # each request's output length at the step: drafts[i][j] meets output_ids[starts[i] + j]
    drafts: list[list[int]]  # the drafts a verify would have scored (capped under cap-accept)
    age: int = 0  # decode steps since the shadow step

    def scored(self) -> list[Optional[int]]:
        """Per request, the tokens a verify would have committed (None while its next tokens are not all out)."""
        return [
            shadow_committed_tokens(d, r.output_ids[s : s + len(d) + 1], r.finished)
            for r, s, d in zip(self.reqs, self.starts, self.drafts)
        ]

    def sample(self) -> Optional[list[int]]:
        """One decode step later: None while the probe waits for tokens; else the scored requests' committed tokens
        (all of them, or those scored when it grew too old to wait, possibly none)."""
        self.age += 1
        scored = self.scored()
        if None in scored and self.age <= SHADOW_PROBE_MAX_AGE_STEPS:
            return None
        return [n for n in scored if n is not None]
