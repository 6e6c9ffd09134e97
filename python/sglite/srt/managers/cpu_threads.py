"""Per-process CPU thread policy: scheduler ranks own the compute threads, every other process runs one.

Why: OpenMP workers of a parallel region wait for each other at its barrier. When the scheduler runs as
many compute threads as the box has cores, the HTTP/tokenizer and detokenizer processes (and any
benchmark client) preempt one of them every few tokens, and the rest of the team waits a scheduler
time slice at every barrier of the step: on the 2-core box a plain server's median ITL went from
44-84 ms at 1 compute thread to 260-350 ms at 2 (docs/benchmarks.md, "Serving stalls"). So:

- a scheduler rank runs ``--cpu-threads`` threads; without the flag, the cores listed for its rank in
  ``SGLANG_CPU_OMP_THREADS_BIND`` (SGLang's CPU variable: ``"0-3|4-7"``, one ``|``-separated CPU list
  per TP rank, to which the rank is also pinned), else ``OMP_NUM_THREADS`` when the user set it, else the
  process's CPUs less one reserved for the front-end processes (as vLLM's CPU build reserves one by
  default), split over the TP ranks;
- idle OpenMP workers of a scheduler sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, and
  ``KMP_BLOCKTIME=0`` for Intel's runtime), unless the user set them: a spinning worker holds a core the
  front end needs. With it, 2 compute threads on the 2-core box served 308-469 tok/s at 12-33 ms median
  ITL against 30-34 tok/s at 260-350 ms spinning. The policy is read when the OpenMP runtime starts, so
  it is put in the environment a scheduler process is spawned with (``scheduler_spawn_env``);
- the detokenizer and the HTTP/tokenizer process run one torch thread and no tokenizer thread pool.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

OMP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# CPUs left to the HTTP/tokenizer and detokenizer processes when neither the flag nor the env says.
RESERVED_FRONTEND_CPUS = 1


@dataclass(frozen=True)
class CpuThreadPlan:
    """How many compute threads one scheduler rank runs, and the CPUs it is pinned to (None: not pinned)."""

    num_threads: int
    cpus: Optional[tuple[int, ...]] = None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6); a malformed list is a ValueError naming it."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{OMP_BIND_ENV}: {text!r} is not a CPU list like '0-3' or '0,2,4'") from None
    return tuple(cpus)


def plan_cpu_threads(
    cpu_threads: Optional[int],
    tp_rank: int,
    tp_size: int,
    bind: Optional[str],
    available_cpus: int,
    omp_num_threads: Optional[str] = None,
) -> CpuThreadPlan:
    """The thread plan of TP rank ``tp_rank`` (pure: the flag, the env values, the CPUs this process may use)."""
    cpus = None
    if bind:
        lists = bind.split("|")
        if len(lists) != tp_size:
            raise ValueError(f"{OMP_BIND_ENV} lists {len(lists)} CPU set(s) for --tp-size {tp_size}; give one per rank")
        cpus = parse_cpu_list(lists[tp_rank])
    if cpu_threads is not None:
        return CpuThreadPlan(cpu_threads, cpus)
    if cpus is not None:
        return CpuThreadPlan(len(cpus), cpus)
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) >= 1:
        return CpuThreadPlan(int(omp_num_threads))
    return CpuThreadPlan(max(1, (available_cpus - RESERVED_FRONTEND_CPUS) // tp_size))


def apply_scheduler_threads(cpu_threads: Optional[int], tp_rank: int, tp_size: int) -> CpuThreadPlan:
    """Pin and size this scheduler rank's compute threads (call at process start, before the model loads)."""
    import torch

    plan = plan_cpu_threads(
        cpu_threads, tp_rank, tp_size, os.environ.get(OMP_BIND_ENV), len(os.sched_getaffinity(0)),
        os.environ.get("OMP_NUM_THREADS"),
    )
    if plan.cpus is not None:
        os.sched_setaffinity(0, plan.cpus)
    torch.set_num_threads(plan.num_threads)
    return plan


# Set only where the user left them unset; read by the OpenMP runtime of the spawned process at start-up.
SCHEDULER_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
FRONTEND_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@contextlib.contextmanager
def _spawn_env(defaults: dict[str, str]) -> Iterator[None]:
    added = [k for k in defaults if k not in os.environ]
    os.environ.update({k: defaults[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def scheduler_spawn_env() -> contextlib.AbstractContextManager[None]:
    """Wrap a scheduler process's start(): its OpenMP workers sleep when idle (user settings win)."""
    return _spawn_env(SCHEDULER_OMP_ENV)


def frontend_spawn_env() -> contextlib.AbstractContextManager[None]:
    """Wrap a front-end process's start() (detokenizer): one OpenMP thread from its first import of torch."""
    return _spawn_env(FRONTEND_ENV)


def limit_to_one_thread() -> None:
    """A front-end process (HTTP/tokenizer, detokenizer): one torch/OpenMP thread, no tokenizer pool."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the Rust tokenizers at their first batch call
    import torch

    torch.set_num_threads(1)
