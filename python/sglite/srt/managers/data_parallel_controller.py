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
its outputs to its own controller socket, so a reply is always attributable to its group. It only
routes: the launcher (``entrypoints/launcher.py``) places the ranks and starts every process.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    PortArgs,
    TokenizedGenerateReqInput,
)
from sglite.srt.server_args import LOAD_BALANCE_METHODS, ServerArgs

logger = logging.getLogger(__name__)


# ====================================================================== endpoints
@dataclass(frozen=True)
class DPEndpoints:
    """ZMQ endpoints of the controller: one input and one output endpoint per DP group."""

    group_input_ipc_names: list[str]  # controller PUSH -> group front PULL (the front binds, or connects: below)
    group_output_ipc_names: list[str]  # group front PUSH (connects) -> controller PULL (binds)
    fronts_connect: bool = False  # multi-node: the controller binds the inputs too, at node 0's address

    @classmethod
    def create(cls, ipc_dir: str, dp_size: int, tcp_base: Optional[tuple[str, int]] = None) -> "DPEndpoints":
        """Endpoints in the server's ipc dir (removed with it at shutdown), or, across nodes (``tcp_base``: node 0's
        host and a base port), TCP ports ``base + 2d`` (input) and ``base + 2d + 1`` (output) of group d there."""
        if tcp_base is not None:
            host, base = tcp_base
            return cls(
                [f"tcp://{host}:{base + 2 * d}" for d in range(dp_size)],
                [f"tcp://{host}:{base + 2 * d + 1}" for d in range(dp_size)],
                fronts_connect=True,
            )
        return cls(
            [f"ipc://{os.path.join(ipc_dir, f'dp{d}_input')}" for d in range(dp_size)],
            [f"ipc://{os.path.join(ipc_dir, f'dp{d}_output')}" for d in range(dp_size)],
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

    def assign(self, rid: str, bootstrap_room: Optional[int] = None) -> int:
        """The group that will serve rid (recorded until ``finished(rid)``).

        ``follow_bootstrap_room`` (PD prefill nodes): group ``bootstrap_room % dp``, the group the decode
        node's ranks ask for that room's KV; a request without a room takes the round-robin turn.
        """
        if self.method == "follow_bootstrap_room" and bootstrap_room is not None:
            group = int(bootstrap_room) % self.dp_size
        elif self.method in ("round_robin", "follow_bootstrap_room"):
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
    for key in ("available_kv_slots", "num_running_reqs", "num_waiting_reqs", "num_retractions", "last_gen_throughput",
                "spec_drafted_steps", "spec_draft_free_steps"):
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
            self.send_to_group(self.balancer.assign(msg.rid, msg.bootstrap_room), msg)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            by_group: dict[int, list[TokenizedGenerateReqInput]] = {}
            for req in msg.batch:
                by_group.setdefault(self.balancer.assign(req.rid, req.bootstrap_room), []).append(req)
            for group, reqs in by_group.items():  # each group still admits its share of the batch together
                self.send_to_group(group, BatchTokenizedGenerateReqInput(batch=reqs))
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
    for name in endpoints.group_input_ipc_names:  # each front binds its input (run_scheduler_process), or connects
        sock = ctx.socket(zmq.PUSH)
        sock.bind(name) if endpoints.fronts_connect else sock.connect(name)
        to_groups.append(sock)
    from_groups = []
    for name in endpoints.group_output_ipc_names:
        sock = ctx.socket(zmq.PULL)
        sock.bind(name)
        from_groups.append(sock)
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(port_args.detokenizer_ipc_name)
    controller = DataParallelController(
        server_args.dp_size, server_args.resolved_load_balance_method(),
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
