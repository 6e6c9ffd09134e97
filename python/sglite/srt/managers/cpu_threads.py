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
  default), split over the scheduler ranks;
- without a CPU list (the variable unset, or SGLang's default ``all``), each rank is pinned to its own
  consecutive CPUs, first ranks first, whenever the ranks leave at least one CPU over; the front-end
  processes (detokenizer, DP controller, ``sglite serve``'s HTTP process) are pinned to the CPUs left.
  vLLM's CPU build binds its compute threads the same way (``VLLM_CPU_OMP_THREADS_BIND=auto``). Unpinned,
  the kernel moved the compute thread between the 2 cores as the front end woke: on the 200 M model at
  concurrency 8 a server gave 95-100 tok/s against 118-121 pinned (docs/benchmarks.md, "CPU pinning");
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
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from sglite.srt.server_args import ServerArgs

OMP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# SGLang's default value of OMP_BIND_ENV: no explicit lists, bind automatically.
OMP_BIND_AUTO = "all"
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
    rank_index: int,
    num_ranks: int,
    bind: Optional[str],
    available: tuple[int, ...],
    omp_num_threads: Optional[str] = None,
    tp_rank: Optional[int] = None,
    tp_size: Optional[int] = None,
) -> CpuThreadPlan:
    """The thread plan of scheduler rank ``rank_index`` of ``num_ranks`` (pure: the flag, the env values, the CPUs
    this process may use). A CPU list in ``bind`` is read per TP rank (``tp_rank`` of ``tp_size``, by default
    the rank's index among all ranks)."""
    if bind and bind.strip() != OMP_BIND_AUTO:
        lists = bind.split("|")
        tp_rank, tp_size = (rank_index, num_ranks) if tp_rank is None or tp_size is None else (tp_rank, tp_size)
        if len(lists) != tp_size:
            raise ValueError(f"{OMP_BIND_ENV} lists {len(lists)} CPU set(s) for --tp-size {tp_size}; give one per rank")
        cpus = parse_cpu_list(lists[tp_rank])
        return CpuThreadPlan(len(cpus) if cpu_threads is None else cpu_threads, cpus)
    if cpu_threads is not None:
        num_threads = cpu_threads
    elif omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) >= 1:
        num_threads = int(omp_num_threads)
    else:
        num_threads = max(1, (len(available) - RESERVED_FRONTEND_CPUS) // num_ranks)
    return CpuThreadPlan(num_threads, _auto_cpus(available, num_threads, rank_index, num_ranks))


def _auto_cpus(
    available: tuple[int, ...], num_threads: int, rank_index: int, num_ranks: int
) -> Optional[tuple[int, ...]]:
    """Rank ``rank_index``'s consecutive share of ``available``, when the ranks leave a CPU for the front end."""
    if num_threads * num_ranks >= len(available):
        return None  # pinning would leave the front end no CPU of its own
    first = rank_index * num_threads
    return tuple(sorted(available)[first : first + num_threads])


def frontend_cpus(
    cpu_threads: Optional[int], num_ranks: int, bind: Optional[str], available: tuple[int, ...],
    omp_num_threads: Optional[str] = None,
) -> Optional[tuple[int, ...]]:
    """The CPUs the front-end processes are pinned to: those the auto-pinned ranks leave (None: no auto pinning)."""
    if bind and bind.strip() != OMP_BIND_AUTO:
        return None  # the user placed the ranks; the front end is theirs to place as well
    taken: set[int] = set()
    for i in range(num_ranks):
        cpus = plan_cpu_threads(cpu_threads, i, num_ranks, bind, available, omp_num_threads).cpus
        if cpus is None:
            return None
        taken.update(cpus)
    return tuple(c for c in sorted(available) if c not in taken)


def scheduler_rank_index(rank: int, world_size: int, dp_rank: int, enable_dp_attention: bool) -> int:
    """A scheduler process's index among all of its server's (the launcher's global rank)."""
    return rank if enable_dp_attention else dp_rank * world_size + rank


def _server_inputs(server_args: "ServerArgs") -> dict:
    """What a plan reads besides the rank: the flag, the rank count, the env values and this process's CPUs."""
    return dict(
        cpu_threads=server_args.cpu_threads,
        num_ranks=server_args.num_scheduler_ranks,
        bind=os.environ.get(OMP_BIND_ENV),
        available=tuple(os.sched_getaffinity(0)),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    )


def apply_scheduler_threads(server_args: "ServerArgs", rank: int, world_size: int, dp_rank: int = 0) -> CpuThreadPlan:
    """Pin and size this scheduler rank's compute threads (call at process start, before the model loads)."""
    import torch

    plan = plan_cpu_threads(
        rank_index=scheduler_rank_index(rank, world_size, dp_rank, server_args.enable_dp_attention),
        tp_rank=rank,
        tp_size=world_size,
        **_server_inputs(server_args),
    )
    if plan.cpus is not None:
        pin_process(0, plan.cpus)
    torch.set_num_threads(plan.num_threads)
    return plan


def pin_process(pid: int, cpus: tuple[int, ...]) -> None:
    """Pin every thread of process ``pid`` (0: this one) to ``cpus``; threads started later inherit it.

    ``sched_setaffinity`` moves one thread, so threads already running (ZMQ's, a watchdog's) are pinned one by one.
    """
    task_dir = f"/proc/{pid or os.getpid()}/task"
    tids = [int(t) for t in os.listdir(task_dir)] if os.path.isdir(task_dir) else [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def pin_to_frontend_cpus(server_args: "ServerArgs", pid: int = 0) -> Optional[tuple[int, ...]]:
    """Pin process ``pid`` (0: this one) to the CPUs the server's scheduler ranks leave; call before any pinning."""
    cpus = frontend_cpus(**_server_inputs(server_args))
    if cpus:
        pin_process(pid, cpus)
    return cpus


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
