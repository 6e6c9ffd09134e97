"""AcceptEstimate: the accept length of a draft, counted per request, with its standard error.

``AdaptiveSpeculation`` (``adaptive.py``) reads one estimate for every batch size: the draft's quality on the traffic
does not depend on how many requests share a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
