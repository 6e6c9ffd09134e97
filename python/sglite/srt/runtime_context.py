"""Per-process runtime context: the parallel bag (configured sizes, then the live widths and groups).

Invariants:
- The bag is published once per process (``publish``); a second publish is an error.
  Tests and ``sglite plan`` (which simulates many ranks in one process) use ``scoped`` instead.
- Configured leaves (``tp_size``, ``dp_size``, ``enable_dp_attention``, ``attn_cp_size``, ...) are
  readable as soon as the bag is published.
- Live widths and ranks (``attn_tp_size``, ``attn_dp_size``, ``tp_rank``, groups, ...) exist only
  after the parallel runtime stamps them (``ParallelState.stamp``). Reading one earlier raises
  ``ParallelNotInitializedError`` naming the init step that has not run: there is no fallback value.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional


class ParallelNotInitializedError(RuntimeError):
    """A live parallel width or rank was read before the parallel runtime stamped it."""


@dataclass(frozen=True)
class AttentionWidths:
    """Attention widths derived from the configured parallel sizes."""

    attn_tp_size: int
    attn_dp_size: int
    attn_cp_size: int


def derive_attention_widths(
    tp_size: int, dp_size: int, enable_dp_attention: bool, attn_cp_size: int = 1
) -> AttentionWidths:
    """Pure arithmetic of SGLang's DP attention: attn_dp = dp if DP attention else 1, attn_tp = tp/attn_dp/cp."""
    if tp_size < 1 or dp_size < 1 or attn_cp_size < 1:
        raise ValueError(
            f"parallel sizes must be >= 1 (tp_size={tp_size}, dp_size={dp_size}, attn_cp_size={attn_cp_size})"
        )
    attn_dp_size = dp_size if enable_dp_attention else 1
    if tp_size % (attn_dp_size * attn_cp_size) != 0:
        raise ValueError(
            f"--tp-size {tp_size} is not divisible by attention DP x CP = {attn_dp_size} x {attn_cp_size}"
        )
    attn_tp_size = tp_size // attn_dp_size // attn_cp_size
    return AttentionWidths(attn_tp_size=attn_tp_size, attn_dp_size=attn_dp_size, attn_cp_size=attn_cp_size)


# Live fields and the init step that stamps each; used for the "not yet initialised" message.
_LIVE_FIELDS = {
    "world_size": "init_distributed_environment",
    "rank": "init_distributed_environment",
    "backend": "init_distributed_environment",
    "tp_rank": "initialize_model_parallel",
    "attn_tp_size": "initialize_model_parallel",
    "attn_tp_rank": "initialize_model_parallel",
    "attn_cp_rank": "initialize_model_parallel",
    "tp_group": "initialize_model_parallel",
    "attn_tp_group": "initialize_model_parallel",
    "attn_cp_group": "initialize_model_parallel",
    "attn_dp_size": "initialize_dp_attention",
    "attn_dp_rank": "initialize_dp_attention",
    "dp_rank": "initialize_dp_attention",
}


def check_attn_cp_supported(attn_cp_size: int) -> None:
    """Refuse attention context parallelism, which no sglite model (target or DFLASH/DSPARK draft) implements.

    The layers call this when they resolve their group, and `sglite plan` calls it for a topology with
    a draft, so both refuse with this one message.
    """
    if attn_cp_size > 1:
        raise ValueError(
            f"--attn-cp-size {attn_cp_size}: attention context parallelism is not implemented for "
            "Llama-family models or their DFLASH/DSPARK drafts; use --attn-cp-size 1"
        )


class ParallelState:
    """Configured parallel sizes plus live widths/ranks stamped by ``init_parallel_runtime``."""

    def __init__(
        self,
        tp_size: int = 1,
        dp_size: int = 1,
        enable_dp_attention: bool = False,
        attn_cp_size: int = 1,
        pp_size: int = 1,
        ep_size: int = 1,
    ) -> None:
        self.tp_size = tp_size
        self.ep_size = ep_size  # MoE experts split over this many ranks of the TP group
        self.dp_size = dp_size
        self.enable_dp_attention = enable_dp_attention
        self.attn_cp_size = attn_cp_size
        self.pp_size = pp_size
        self._live: dict[str, Any] = {}

    def derived_widths(self) -> AttentionWidths:
        """Widths the configured sizes imply (for validation and planning, never for pool builders)."""
        return derive_attention_widths(self.tp_size, self.dp_size, self.enable_dp_attention, self.attn_cp_size)

    def stamp(self, **live: Any) -> None:
        """Record live widths/ranks; called only by the parallel runtime (or a simulated rank)."""
        for name in live:
            if name not in _LIVE_FIELDS:
                raise KeyError(f"unknown live parallel field {name!r}")
        self._live.update(live)

    def is_stamped(self, name: str) -> bool:
        """Whether a live field has been stamped."""
        return name in self._live

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not set in __init__, i.e. the live fields.
        if name.startswith("_"):
            raise AttributeError(name)
        step = _LIVE_FIELDS.get(name)
        if step is None:
            raise AttributeError(f"ParallelState has no field {name!r}")
        live = self.__dict__.get("_live", {})
        if name not in live:
            raise ParallelNotInitializedError(
                f"parallel width {name!r} is not available: {step}() has not run in this process "
                f"(call init_parallel_runtime() first; there is no fallback value)"
            )
        return live[name]

    def summary(self) -> dict[str, Any]:
        """Configured and stamped values, for logs and /get_server_info."""
        out: dict[str, Any] = {
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "enable_dp_attention": self.enable_dp_attention,
            "attn_cp_size": self.attn_cp_size,
            "pp_size": self.pp_size,
            "ep_size": self.ep_size,
        }
        out.update({k: v for k, v in self._live.items() if not k.endswith("_group")})
        return out


@dataclass
class _Context:
    parallel: Optional[ParallelState] = None


_CTX = _Context()


def publish(parallel: ParallelState) -> None:
    """Publish this process's parallel bag; it may be published once."""
    if _CTX.parallel is not None:
        raise RuntimeError("runtime context bag 'parallel' was already published in this process")
    _CTX.parallel = parallel


@contextlib.contextmanager
def scoped(parallel: ParallelState) -> Iterator[None]:
    """Temporarily publish a parallel bag (tests, and `sglite plan` simulating one rank at a time)."""
    saved = _CTX.parallel
    _CTX.parallel = parallel
    try:
        yield
    finally:
        _CTX.parallel = saved


def get_parallel() -> ParallelState:
    """The published parallel bag."""
    if _CTX.parallel is None:
        raise RuntimeError("runtime context bag 'parallel' has not been published in this process")
    return _CTX.parallel
