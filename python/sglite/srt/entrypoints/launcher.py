"""The launcher: spawns and watches every process of a server (the HTTP server and ``Engine`` sit on it).

``launch_subprocesses`` starts one scheduler process per rank and the detokenizer process (spawned,
each exiting with its parent), and with ``--dp-size > 1`` the data-parallel controller in front of
the DP groups; waits for every rank's ``SchedulerReady``; logs each rank's report; and builds the
``TokenizerManager`` in this process. Any failure during start-up kills what was started.

DP topologies (``docs/parallelism.md``): without DP attention N independent TP worlds of ``tp_size``
ranks each (own rendezvous each); with ``--enable-dp-attention`` one world of ``tp_size`` ranks whose
attention-DP groups (``attn_tp = tp / dp`` consecutive ranks) each schedule their own requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

from sglite.srt.managers.base_model_worker import format_rank_report
from sglite.srt.managers.cpu_threads import frontend_spawn_env, pin_to_frontend_cpus, scheduler_spawn_env
from sglite.srt.managers.data_parallel_controller import DPEndpoints, run_data_parallel_controller_process
from sglite.srt.managers.detokenizer_manager import load_tokenizer
from sglite.srt.managers.io_struct import PortArgs, SchedulerInitError, SchedulerReady, free_port
from sglite.srt.managers.tokenizer_manager import TokenizerManager
from sglite.srt.server_args import ServerArgs, host_port

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[..., None]


class LaunchError(RuntimeError):
    """A subprocess failed to start; the message says which and why."""


@dataclass
class LaunchedRuntime:
    """Everything the front end holds after start-up."""

    server_args: ServerArgs
    port_args: PortArgs
    tokenizer_manager: TokenizerManager
    scheduler_info: SchedulerReady  # rank 0's
    processes: list[tuple[str, Any]]  # (name, multiprocessing.Process)
    rank_infos: list[SchedulerReady]  # every rank's, in rank order (per-rank memory plans)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the subprocesses (terminate, then kill) and remove the ipc dir."""
        self.tokenizer_manager.close()
        for _, proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for _, proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)


def _default_scheduler_entry() -> SchedulerEntry:
    from sglite.srt.managers.scheduler_process import run_scheduler_process

    return run_scheduler_process


def launch_subprocesses(
    server_args: ServerArgs,
    *,
    scheduler_entry: Optional[SchedulerEntry] = None,
    startup_timeout_s: float = 600.0,
) -> LaunchedRuntime:
    """Start scheduler ranks + detokenizer, wait until ready, return the runtime (raises LaunchError)."""
    entry = scheduler_entry or _default_scheduler_entry()
    if server_args.dp_size > 1:  # DP replicas or DP attention: a controller in front of the DP groups
        return _launch_dp_subprocesses(server_args, scheduler_entry=entry, startup_timeout_s=startup_timeout_s)
    port_args = PortArgs.create(server_args)
    ctx = mp.get_context("spawn")
    world_size = server_args.tp_size
    processes: list[tuple[str, Any]] = []
    readers = []
    with kill_on_failure(processes, port_args.ipc_dir):
        for rank in server_args.local_ranks():  # all of them on one node; node 0's share across nodes
            spawn_tp_rank(ctx, entry, server_args, port_args, rank, processes, readers)
        detok = spawn_detokenizer(ctx, server_args, port_args, processes)
        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        infos = [wait_ready(name, proc, reader, startup_timeout_s) for (name, proc), reader in zip(processes, readers)]
        if not detok.is_alive():
            raise LaunchError(f"the detokenizer process exited during start-up with code {detok.exitcode}")
    for info_r in infos:
        if info_r.rank_report is not None:
            logger.info("%s", format_rank_report(info_r.rank_report))
    info = infos[0]
    tm = TokenizerManager(server_args, port_args, tokenizer, info, child_processes=processes)
    return LaunchedRuntime(server_args, port_args, tm, info, processes, infos)


def spawn_scheduler_rank(
    ctx: Any, entry: SchedulerEntry, args: tuple, proc_name: str, label: str,
    processes: list[tuple[str, Any]], readers: list[Any],
    start_context: ContextManager[Any] = contextlib.nullcontext(),
) -> None:
    """Start one scheduler rank (entry(*args, ready_pipe)); record it as (label, proc) and its pipe's reader.

    ``start_context`` wraps ``proc.start()`` (the DP launcher pins the replica's visible devices there)."""
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=entry, args=(*args, writer), name=proc_name, daemon=True)
    with start_context, scheduler_spawn_env():
        proc.start()
    writer.close()  # the child holds the only write end: EOF on the reader means it died
    processes.append((label, proc))
    readers.append(reader)


def spawn_tp_rank(ctx: Any, entry: SchedulerEntry, server_args: ServerArgs, port_args: PortArgs, rank: int,
                  processes: list[tuple[str, Any]], readers: list[Any]) -> None:
    """Start TP rank ``rank`` of a server without DP groups."""
    spawn_scheduler_rank(ctx, entry, (server_args, port_args, rank, server_args.tp_size), f"sglite-scheduler-{rank}",
                         f"scheduler rank {rank}", processes, readers)


def spawn_placed_rank(ctx: Any, entry: SchedulerEntry, server_args: ServerArgs, port_args: PortArgs,
                      endpoints: "DPEndpoints", pl: "RankPlacement", processes: list[tuple[str, Any]],
                      readers: list[Any], devices: Optional[str] = None) -> None:
    """Start the rank of a DP server at placement ``pl`` (``devices``: its replica's visible CUDA devices)."""
    spawn_scheduler_rank(
        ctx, entry, (server_args, group_port_args(port_args, endpoints, pl), pl.rank, pl.world_size),
        f"sglite-scheduler-dp{pl.dp_rank}-rank{pl.global_rank}", f"scheduler rank {pl.global_rank} (dp_rank {pl.dp_rank})",
        processes, readers, start_context=_visible_devices(devices),
    )


def spawn_detokenizer(ctx: Any, server_args: ServerArgs, port_args: PortArgs, processes: list[tuple[str, Any]]) -> Any:
    """Start the detokenizer process and record it as ("detokenizer", proc); returns the process."""
    from sglite.srt.managers.detokenizer_manager import run_detokenizer_process

    detok = ctx.Process(
        target=run_detokenizer_process, args=(server_args, port_args), name="sglite-detokenizer", daemon=True
    )
    with frontend_spawn_env():
        detok.start()
    pin_to_frontend_cpus(server_args, detok.pid)  # off the scheduler ranks' CPUs, before it imports torch
    processes.append(("detokenizer", detok))
    return detok


def wait_ready(name: str, proc: Any, reader: Any, timeout_s: float) -> SchedulerReady:
    """The rank's SchedulerReady from its pipe; a LaunchError if it failed, died or timed out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reader.poll(0.5):
            try:
                msg = reader.recv()
            except EOFError:
                proc.join(2.0)
                raise LaunchError(f"{name} closed its pipe during start-up (exit code {proc.exitcode})") from None
            if isinstance(msg, SchedulerInitError):
                raise LaunchError(f"{name} failed to start: {msg.message}\n{msg.traceback}")
            if not isinstance(msg, SchedulerReady):
                raise LaunchError(f"{name} sent {type(msg).__name__} instead of SchedulerReady")
            return msg
        if not proc.is_alive():
            raise LaunchError(f"{name} exited during start-up with code {proc.exitcode} (see its log above)")
    raise LaunchError(f"{name} was not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def kill_on_failure(processes: list[tuple[str, Any]], ipc_dir: str) -> Iterator[None]:
    """On any failure inside (Ctrl-C included) kill the started processes and remove ipc_dir, then re-raise."""
    try:
        yield
    except BaseException:
        _kill_all(processes)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise


def _kill_all(processes: list[tuple[str, Any]]) -> None:
    for _, proc in processes:
        if proc.is_alive():
            proc.kill()
    for _, proc in processes:
        proc.join(2.0)


# ====================================================================== DP placement
@dataclass(frozen=True)
class RankPlacement:
    """One scheduler process: its rank inside its torch world, that world, and its DP group."""

    global_rank: int  # 0..dp*tp-1 without DP attention, 0..tp-1 with it (a label for logs and pids)
    rank: int  # rank inside its torch.distributed world
    world_size: int
    dp_rank: int  # the DP group (replica, or attention-DP group) the rank serves
    is_front: bool  # first rank of its DP group: talks to the controller
    dist_init_method: str


def plan_dp_placements(server_args: ServerArgs, dist_init_methods: list[str]) -> list[RankPlacement]:
    """Every scheduler process of a DP server, in global-rank order (``dist_init_methods``: one per world)."""
    tp, dp = server_args.tp_size, server_args.dp_size
    if server_args.attn_cp_size != 1:
        raise ValueError("--attn-cp-size > 1 is not supported with --dp-size > 1; set --attn-cp-size 1")
    if server_args.enable_dp_attention:
        if len(dist_init_methods) != 1:
            raise ValueError("DP attention runs one torch world; pass exactly one rendezvous")
        attn_tp = tp // dp
        return [
            RankPlacement(r, r, tp, r // attn_tp, r % attn_tp == 0, dist_init_methods[0]) for r in range(tp)
        ]
    if len(dist_init_methods) != dp:
        raise ValueError(f"{dp} DP replicas need {dp} rendezvous addresses, got {len(dist_init_methods)}")
    return [
        RankPlacement(d * tp + r, r, tp, d, r == 0, dist_init_methods[d]) for d in range(dp) for r in range(tp)
    ]


def group_port_args(port_args: PortArgs, endpoints: DPEndpoints, placement: RankPlacement) -> PortArgs:
    """The PortArgs a rank's scheduler process sees: its group's controller endpoints and its world's rendezvous."""
    return dataclasses.replace(
        port_args,
        scheduler_input_ipc_name=endpoints.group_input_ipc_names[placement.dp_rank],
        detokenizer_ipc_name=endpoints.group_output_ipc_names[placement.dp_rank],
        dist_init_method=placement.dist_init_method,
        dp_rank=placement.dp_rank,  # the replica index (with DP attention the runtime derives the same value)
        fronts_connect=endpoints.fronts_connect,
    )


def local_dp_placements(server_args: ServerArgs, dist_init_methods: list[str]) -> list[RankPlacement]:
    """The placements of the ranks this node runs (all of them on one node)."""
    local = set(server_args.local_ranks())
    return [pl for pl in plan_dp_placements(server_args, dist_init_methods) if pl.global_rank in local]


def front_tcp_base(server_args: ServerArgs) -> Optional[tuple[str, int]]:
    """Across nodes: node 0's host and the first port of the front ends' TCP endpoints (--dist-init-addr's + 1)."""
    if server_args.nnodes == 1:
        return None
    host, port = host_port(server_args.dist_init_addr)  # validate() checked it parses
    return host, port + 1



# ====================================================================== DP launch
def _launch_dp_subprocesses(server_args: ServerArgs, *, scheduler_entry: Callable[..., None],
                           startup_timeout_s: float = 600.0) -> LaunchedRuntime:
    """Start every DP group's scheduler ranks, the controller and the detokenizer; return a LaunchedRuntime."""
    port_args = PortArgs.create(server_args)
    n_worlds = 1 if server_args.enable_dp_attention else server_args.dp_size
    # The first world keeps --dist-init-addr (or the PortArgs port); further replicas get fresh local ports.
    inits = [port_args.dist_init_method] + [f"tcp://127.0.0.1:{free_port()}" for _ in range(n_worlds - 1)]
    placements = local_dp_placements(server_args, inits)
    endpoints = DPEndpoints.create(port_args.ipc_dir, server_args.dp_size, front_tcp_base(server_args))
    ctx = mp.get_context("spawn")
    processes: list[tuple[str, Any]] = []
    readers = []
    with kill_on_failure(processes, port_args.ipc_dir):
        controller = ctx.Process(
            target=run_data_parallel_controller_process, args=(server_args, port_args, endpoints),
            name="sglite-dp-controller", daemon=True,
        )
        controller.start()
        pin_to_frontend_cpus(server_args, controller.pid)
        processes.append(("data-parallel controller", controller))
        replica_devices = _replica_cuda_devices(server_args)
        for pl in placements:
            spawn_placed_rank(ctx, scheduler_entry, server_args, port_args, endpoints, pl, processes, readers,
                              devices=replica_devices[pl.dp_rank] if replica_devices else None)
        spawn_detokenizer(ctx, server_args, port_args, processes)
        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        infos = [
            wait_ready(name, proc, reader, startup_timeout_s)
            for (name, proc), reader in zip(processes[1 : 1 + len(placements)], readers)
        ]
        for name, proc in processes:
            if not proc.is_alive():
                raise LaunchError(f"the {name} process exited during start-up with code {proc.exitcode}")
    for pl, info in zip(placements, infos):
        report = getattr(info, "rank_report", None)
        if report is not None:
            if report["dp_rank"] != pl.dp_rank:
                raise LaunchError(f"scheduler rank {pl.global_rank} reports dp_rank {report['dp_rank']}, placed at {pl.dp_rank}")
            report["global_rank"] = pl.global_rank
            logger.info("%s", format_rank_report(report))
    fronts = [info for pl, info in zip(placements, infos) if pl.is_front]
    # The front end validates requests against the smallest group: any group may get any request.
    merged = dataclasses.replace(
        fronts[0],
        max_total_num_tokens=min(f.max_total_num_tokens for f in fronts),
        max_running_requests=sum(f.max_running_requests for f in fronts),
    )
    tm = TokenizerManager(server_args, port_args, tokenizer, merged, child_processes=processes)
    return LaunchedRuntime(server_args, port_args, tm, merged, processes, infos)



def _replica_cuda_devices(server_args: ServerArgs) -> Optional[list[str]]:
    """CUDA replicas without DP attention: the devices of each replica (its rank r uses the r-th), else None.

    Each replica is its own torch world whose ranks pick ``rank % device_count``; without a per-replica
    device list every replica's rank 0 would land on the same GPU.
    """
    if server_args.enable_dp_attention or server_args.resolved_device() != "cuda":
        return None
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in env.split(",") if d.strip()] if env else [str(i) for i in range(torch.cuda.device_count())]
    need = server_args.dp_size * server_args.tp_size
    if len(visible) < need:
        raise ValueError(
            f"--dp-size {server_args.dp_size} x --tp-size {server_args.tp_size} needs {need} GPUs but {len(visible)} "
            "are visible; lower --dp-size / --tp-size or use --enable-dp-attention"
        )
    tp = server_args.tp_size
    return [",".join(visible[d * tp : (d + 1) * tp]) for d in range(server_args.dp_size)]


@contextlib.contextmanager
def _visible_devices(devices: Optional[str]) -> Iterator[None]:
    """Set CUDA_VISIBLE_DEVICES while a spawned child starts (it copies the environment at start)."""
    if devices is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


# ====================================================================== nodes other than 0
def run_worker_node(server_args: ServerArgs, *, scheduler_entry: Optional[SchedulerEntry] = None,
                    startup_timeout_s: float = 600.0, poll_s: float = 1.0) -> int:
    """``--node-rank > 0``: start this node's scheduler ranks, then watch them; no HTTP, no detokenizer.

    They join node 0's ranks in one torch world at --dist-init-addr; a front rank (the first of an attention-DP
    group, with DP attention) connects to node 0's controller. When a rank exits, the collectives it shared
    fail on every node, so this node stops the rest and exits 1 with the rank that went first.
    """
    entry = scheduler_entry or _default_scheduler_entry()
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the ranks too (the finally below)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    port_args = PortArgs.create(server_args)
    ctx = mp.get_context("spawn")
    processes: list[tuple[str, Any]] = []
    readers: list[Any] = []
    try:
        with kill_on_failure(processes, port_args.ipc_dir):  # kills what started and removes the ipc dir
            if server_args.dp_size > 1:
                endpoints = DPEndpoints.create(port_args.ipc_dir, server_args.dp_size, front_tcp_base(server_args))
                for pl in local_dp_placements(server_args, [port_args.dist_init_method]):
                    spawn_placed_rank(ctx, entry, server_args, port_args, endpoints, pl, processes, readers)
            else:
                for rank in server_args.local_ranks():
                    spawn_tp_rank(ctx, entry, server_args, port_args, rank, processes, readers)
            infos = [wait_ready(name, proc, reader, startup_timeout_s) for (name, proc), reader in zip(processes, readers)]
    except LaunchError as e:
        logger.error("node %d: start-up failed: %s", server_args.node_rank, e)
        return 1
    for info in infos:
        if info.rank_report is not None:
            logger.info("%s", format_rank_report(info.rank_report))
    logger.info("node %d of %d: scheduler ranks %s ready; node 0 serves HTTP", server_args.node_rank,
                server_args.nnodes, list(server_args.local_ranks()))
    try:
        while True:
            dead = [(name, proc) for name, proc in processes if not proc.is_alive()]
            if dead:
                name, proc = dead[0]
                logger.error("node %d: %s exited with code %s (a node of this server stopped); stopping this node",
                             server_args.node_rank, name, proc.exitcode)
                return 1
            time.sleep(poll_s)
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        _kill_all(processes)
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
