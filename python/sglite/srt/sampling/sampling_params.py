"""Per-request sampling parameters and their validation (one field, one clear message)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Union

# top_k value meaning "no top-k" after normalisation (SGLang uses -1 on the wire, a large int inside).
TOP_K_ALL = 1 << 30
# Stop strings are matched on every new token of the request; more than this is abuse, not a use.
MAX_STOP_STRINGS = 64
# ... and their characters in all: each new token is matched against every stop string's tail.
MAX_STOP_CHARS = 4096
# Temperatures below this sample greedily (SGLang's _SAMPLING_EPS in sampling/sampling_params.py; vLLM
# uses 1e-5): logits / 1e-39 overflow fp32 to inf and the softmax becomes NaN.
SAMPLING_EPS = 1e-6
# Largest n (choices per prompt) and |logit_bias| value accepted (OpenAI's limits).
MAX_N = 128
MAX_LOGIT_BIAS = 100.0


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message starts with the field name."""


@dataclass
class SamplingParams:
    """What to generate and how: length, stopping and the sampling distribution."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # SGLang's field; the fast (Rust) tokenizers sglite decodes with always join special tokens without spaces.
    spaces_between_special_tokens: bool = True
    seed: Optional[int] = None
    n: int = 1
    # Logits processing before sampling (srt/sampling/penaltylib.py), SGLang's names and ranges.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string, OpenAI's JSON keys) -> bias

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "SamplingParams":
        """Build from a request dict, ignoring unknown keys (routers add fields of their own)."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        stop: Union[str, list[str], None] = kwargs.get("stop")
        if isinstance(stop, str):
            kwargs["stop"] = [stop]
        return cls(**kwargs)

    def verify(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Raise SamplingParamsError naming the first invalid field."""

        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name} {why}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", f"must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise bad("stop", f"has {sum(len(s) for s in self.stop)} characters in all; at most {MAX_STOP_CHARS} are allowed")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers")
        if vocab_size is not None and any(t < 0 or t >= vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):  # "no" is truthy
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, f"must be a number in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad("min_new_tokens", f"must be an integer in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens!r}")
        if self.logit_bias is not None:
            self.logit_bias = _verified_logit_bias(self.logit_bias, vocab_size)
        return self

    @property
    def needs_logits_processing(self) -> bool:
        """Any penalty, bias or minimum length that changes the logits before sampling."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_new_tokens > 0
            or bool(self.logit_bias)
        )

    @property
    def is_greedy(self) -> bool:
        """Temperature below SAMPLING_EPS (or top_k 1) selects the argmax."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def normalized_top_k(self) -> int:
        """top_k with -1 mapped to 'all tokens'."""
        return TOP_K_ALL if self.top_k == -1 else self.top_k

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for ZMQ messages and logs)."""
        return asdict(self)


def _verified_logit_bias(bias: Any, vocab_size: Optional[int]) -> dict[str, float]:
    """logit_bias with token-id keys in the vocabulary and values in [-100, 100] (keys as strings)."""
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias must be an object mapping token ids to numbers")
    out: dict[str, float] = {}
    for key, value in bias.items():
        tid = key if _is_int(key) else (int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else None)
        if tid is None:
            raise SamplingParamsError(f"logit_bias keys must be token ids, got {key!r}")
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            raise SamplingParamsError(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})")
        if not _is_num(value) or not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}")
        out[str(tid)] = float(value)
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
