"""Data-parallel serving: the controller between the TokenizerManager and the DP groups' fronts.

Topologies (``docs/parallelism.md``):
- ``--dp-size N`` without DP attention: N independent TP worlds of ``tp_size`` ranks each (own
  rendezvous each); the front of a replica is its rank 0.
- ``--tp-size T --dp-size D --enable-dp-attention``: one world of T ranks; each attention-DP group
  (``attn_tp = T / D`` consecutive ranks) schedules its own requests and its first rank is its front.

Either way the controller sees D groups. It owns the one ``scheduler_input`` endpoint the
TokenizerManager pushes to, dispatches each request to one group (round robin or shortest queue),
routes aborts to the group that owns the request, fans control requests out to every group and
merges their replies, and forwards every group's outputs to the one detokenizer. Each group pushes
its outputs to its own controller socket, so a reply is always attributable to its group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    PortArgs,
    SchedulerReady,
    TokenizedGenerateReqInput,
    free_port,
)
from sglite.srt.server_args import LOAD_BALANCE_METHODS, ServerArgs

logger = logging.getLogger(__name__)



# ====================================================================== layout
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


@dataclass(frozen=True)
class DPEndpoints:
    """ZMQ endpoints of the controller: one input and one output endpoint per DP group."""

    group_input_ipc_names: list[str]  # controller PUSH (connects) -> group front PULL (binds)
    group_output_ipc_names: list[str]  # group front PUSH (connects) -> controller PULL (binds)

    @classmethod
    def create(cls, ipc_dir: str, dp_size: int) -> "DPEndpoints":
        """Endpoints in the server's ipc dir (removed with it at shutdown)."""
        return cls(
            [f"ipc://{os.path.join(ipc_dir, f'dp{d}_input')}" for d in range(dp_size)],
            [f"ipc://{os.path.join(ipc_dir, f'dp{d}_output')}" for d in range(dp_size)],
        )


def group_port_args(port_args: PortArgs, endpoints: DPEndpoints, placement: RankPlacement) -> PortArgs:
    """The PortArgs a rank's scheduler process sees: its group's controller endpoints and its world's rendezvous."""
    return dataclasses.replace(
        port_args,
        scheduler_input_ipc_name=endpoints.group_input_ipc_names[placement.dp_rank],
        detokenizer_ipc_name=endpoints.group_output_ipc_names[placement.dp_rank],
        dist_init_method=placement.dist_init_method,
        dp_rank=placement.dp_rank,  # the replica index (with DP attention the runtime derives the same value)
    )


# ====================================================================== load balancing
class LoadBalancer:
    """Picks a DP group per request and tracks which group owns which request."""

    def __init__(self, dp_size: int, method: str) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method {method!r} is unknown; choose one of {list(LOAD_BALANCE_METHODS)}")
        if dp_size < 1:
            raise ValueError("a load balancer needs at least one DP group")
        self.dp_size = dp_size
        self.method = method
        self.rid_to_group: dict[str, int] = {}
        self.num_in_flight = [0] * dp_size
        self._next = 0

    def assign(self, rid: str) -> int:
        """The group that will serve rid (recorded until ``finished(rid)``)."""
        if self.method == "round_robin":
            group = self._next
            self._next = (self._next + 1) % self.dp_size
        else:  # fewest requests in flight; ties go to the lowest group
            group = min(range(self.dp_size), key=lambda d: (self.num_in_flight[d], d))
        self.rid_to_group[rid] = group
        self.num_in_flight[group] += 1
        return group

    def owner(self, rid: str) -> Optional[int]:
        """The group serving rid, or None once it finished (or was never seen)."""
        return self.rid_to_group.get(rid)

    def finished(self, rid: str) -> None:
        """rid sent its final output: forget it."""
        group = self.rid_to_group.pop(rid, None)
        if group is not None:
            self.num_in_flight[group] -= 1


# ====================================================================== reply merging
def merge_internal_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One internal state for the whole server: totals, plus every group's own state (with dp_rank)."""
    accept = [s["avg_spec_accept_length"] for s in states if s.get("avg_spec_accept_length") is not None]
    merged = dict(states[0])
    for key in ("available_kv_slots", "num_running_reqs", "num_waiting_reqs", "num_retractions", "last_gen_throughput"):
        if all(key in s for s in states):
            merged[key] = sum(s[key] for s in states)
    merged["max_total_num_tokens"] = min(s["max_total_num_tokens"] for s in states)
    merged["avg_spec_accept_length"] = sum(accept) / len(accept) if accept else None
    merged["dp_internal_states"] = [dict(s, dp_rank=d) for d, s in enumerate(states)]
    return merged


@dataclass
class _PendingControl:
    """A control request fanned out to every group, waiting for one reply from each."""

    replies: dict[int, Any] = field(default_factory=dict)


class DataParallelController:
    """The controller's state machine; sockets are injected so unit tests can drive it directly."""

    CONTROL_TYPES = (FlushCacheReq, GetInternalStateReq, HealthCheckReq)
    REPLY_TYPES = (FlushCacheReqOutput, GetInternalStateReqOutput, HealthCheckOutput)

    def __init__(self, dp_size: int, method: str, send_to_group: Callable[[int, Any], None],
                 send_to_detokenizer: Callable[[Any], None]) -> None:
        self.dp_size = dp_size
        self.balancer = LoadBalancer(dp_size, method)
        self.send_to_group = send_to_group
        self.send_to_detokenizer = send_to_detokenizer
        # Every group answers control requests in order, so one FIFO per reply type matches them up.
        self._pending: dict[type, deque[_PendingControl]] = {t: deque() for t in self.REPLY_TYPES}

    def handle_request(self, msg: Any) -> None:
        """A message from the TokenizerManager."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.send_to_group(self.balancer.assign(msg.rid), msg)
        elif isinstance(msg, AbortReq):
            owner = None if msg.abort_all else self.balancer.owner(msg.rid)
            # An unknown rid has finished already (or not arrived): every scheduler treats it as a no-op.
            for d in range(self.dp_size) if owner is None else [owner]:
                self.send_to_group(d, msg)
        elif isinstance(msg, self.CONTROL_TYPES):
            reply_type = self.REPLY_TYPES[self.CONTROL_TYPES.index(type(msg))]
            self._pending[reply_type].append(_PendingControl())
            for d in range(self.dp_size):
                self.send_to_group(d, msg)
        else:
            raise TypeError(f"data-parallel controller got an unknown request type {type(msg).__name__}")

    def handle_output(self, group: int, msg: Any) -> None:
        """A message from group ``group``'s front."""
        if isinstance(msg, BatchTokenIDOut):
            for rid, reason in zip(msg.rids, msg.finished_reasons):
                if reason is not None:
                    self.balancer.finished(rid)
            self.send_to_detokenizer(msg)
            return
        if type(msg) not in self._pending:
            raise TypeError(f"data-parallel controller got an unknown output type {type(msg).__name__} from group {group}")
        queue = self._pending[type(msg)]
        pending = next((p for p in queue if group not in p.replies), None)
        if pending is None:
            raise RuntimeError(f"group {group} sent an unrequested {type(msg).__name__}")
        pending.replies[group] = msg
        while queue and len(queue[0].replies) == self.dp_size:
            done = queue.popleft()
            self.send_to_detokenizer(self._merge([done.replies[d] for d in range(self.dp_size)]))

    @staticmethod
    def _merge(replies: list[Any]) -> Any:
        first = replies[0]
        if isinstance(first, GetInternalStateReqOutput):
            return GetInternalStateReqOutput(internal_state=merge_internal_states([r.internal_state for r in replies]))
        if isinstance(first, FlushCacheReqOutput):
            failed = [f"group {d}: {r.message}" for d, r in enumerate(replies) if not r.success]
            return FlushCacheReqOutput(success=not failed, message="; ".join(failed))
        return first  # HealthCheckOutput: every group answered


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs, endpoints: DPEndpoints) -> None:
    """Process entry: bind the TokenizerManager's scheduler endpoint and relay to/from every DP group."""
    import zmq

    from sglite.srt.managers.subprocess_watchdog import watch_parent

    watch_parent()
    logging.basicConfig(
        level=getattr(logging, str(server_args.log_level).upper(), logging.INFO),
        format="[dp controller] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    ctx = zmq.Context()
    recv_requests = ctx.socket(zmq.PULL)
    recv_requests.bind(port_args.scheduler_input_ipc_name)
    to_groups = []
    for name in endpoints.group_input_ipc_names:  # each front binds its input (run_scheduler_process)
        sock = ctx.socket(zmq.PUSH)
        sock.connect(name)
        to_groups.append(sock)
    from_groups = []
    for name in endpoints.group_output_ipc_names:
        sock = ctx.socket(zmq.PULL)
        sock.bind(name)
        from_groups.append(sock)
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(port_args.detokenizer_ipc_name)
    controller = DataParallelController(
        server_args.dp_size, server_args.load_balance_method,
        lambda d, m: to_groups[d].send_pyobj(m), to_detok.send_pyobj,
    )
    poller = zmq.Poller()
    poller.register(recv_requests, zmq.POLLIN)
    for sock in from_groups:
        poller.register(sock, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if recv_requests in ready:
            controller.handle_request(recv_requests.recv_pyobj())
        for d, sock in enumerate(from_groups):
            if sock in ready:
                controller.handle_output(d, sock.recv_pyobj())


# ====================================================================== per-rank report
def rank_report(worker: Any) -> dict[str, Any]:
    """This rank's widths, KV heads, cell sizes, capacity, and planned vs allocated pool bytes."""
    from sglite.srt.runtime_context import get_parallel

    par = get_parallel()
    plan = worker.memory_plan()
    target = getattr(worker, "model_runner", None) or worker.target_runner
    draft = getattr(worker, "draft_runner", None)
    planned = plan.get("planned_pool_bytes", {})
    return {
        "rank": par.rank,
        "tp_rank": par.tp_rank,
        "dp_rank": par.dp_rank,
        "attn_tp_size": par.attn_tp_size,
        "attn_tp_rank": par.attn_tp_rank,
        "attn_dp_size": par.attn_dp_size,
        "attn_dp_rank": par.attn_dp_rank,
        "target_kv_heads_per_rank": plan.get("target_kv_heads_per_rank"),
        "draft_kv_heads_per_rank": plan.get("draft_kv_heads_per_rank"),
        "target_cell_bytes": plan.get("target_cell_bytes"),
        "draft_cell_bytes": plan.get("draft_cell_bytes"),
        "max_total_num_tokens": plan.get("max_total_num_tokens"),
        "planned_pool_bytes": dict(planned),
        "planned_target_kv_bytes": sum(v for k, v in planned.items() if k.startswith("target_")),
        "planned_draft_kv_bytes": sum(v for k, v in planned.items() if k.startswith("draft_")),
        "allocated_target_kv_bytes": int(target.token_to_kv_pool.nbytes()),
        "allocated_draft_kv_bytes": int(draft.token_to_kv_pool.nbytes()) if draft is not None else 0,
    }


def format_rank_report(report: dict[str, Any]) -> str:
    """One start-up log line for a rank's report."""
    return (
        f"rank {report['rank']} (dp_rank {report['dp_rank']}): attn_tp_size={report['attn_tp_size']} "
        f"attn_dp_size={report['attn_dp_size']} target_kv_heads={report['target_kv_heads_per_rank']} "
        f"draft_kv_heads={report['draft_kv_heads_per_rank']} target_cell_bytes={report['target_cell_bytes']} "
        f"draft_cell_bytes={report['draft_cell_bytes']} max_total_num_tokens={report['max_total_num_tokens']} "
        f"target_kv planned/allocated={report['planned_target_kv_bytes']}/{report['allocated_target_kv_bytes']} "
        f"draft_kv planned/allocated={report['planned_draft_kv_bytes']}/{report['allocated_draft_kv_bytes']}"
    )


# ====================================================================== launcher
def launch_dp_subprocesses(server_args: ServerArgs, *, scheduler_entry: Callable[..., None],
                           startup_timeout_s: float = 600.0) -> Any:
    """Start every DP group's scheduler ranks, the controller and the detokenizer; return a LaunchedRuntime."""
    from sglite.srt.entrypoints.engine import (
        LaunchedRuntime,
        LaunchError,
        _wait_ready,
        kill_on_failure,
        spawn_detokenizer,
        spawn_scheduler_rank,
    )
    from sglite.srt.managers.detokenizer_manager import load_tokenizer
    from sglite.srt.managers.tokenizer_manager import TokenizerManager

    port_args = PortArgs.create(server_args)
    n_worlds = 1 if server_args.enable_dp_attention else server_args.dp_size
    # The first world keeps --dist-init-addr (or the PortArgs port); further replicas get fresh local ports.
    inits = [port_args.dist_init_method] + [f"tcp://127.0.0.1:{free_port()}" for _ in range(n_worlds - 1)]
    placements = plan_dp_placements(server_args, inits)
    endpoints = DPEndpoints.create(port_args.ipc_dir, server_args.dp_size)
    ctx = mp.get_context("spawn")
    processes: list[tuple[str, Any]] = []
    readers = []
    with kill_on_failure(processes, port_args.ipc_dir):
        controller = ctx.Process(
            target=run_data_parallel_controller_process, args=(server_args, port_args, endpoints),
            name="sglite-dp-controller", daemon=True,
        )
        controller.start()
        processes.append(("data-parallel controller", controller))
        replica_devices = _replica_cuda_devices(server_args)
        for pl in placements:
            spawn_scheduler_rank(
                ctx, scheduler_entry, (server_args, group_port_args(port_args, endpoints, pl), pl.rank, pl.world_size),
                f"sglite-scheduler-dp{pl.dp_rank}-rank{pl.global_rank}",
                f"scheduler rank {pl.global_rank} (dp_rank {pl.dp_rank})", processes, readers,
                start_context=_visible_devices(replica_devices[pl.dp_rank] if replica_devices else None),
            )
        spawn_detokenizer(ctx, server_args, port_args, processes)
        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        infos = [
            _wait_ready(name, proc, reader, startup_timeout_s)
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
