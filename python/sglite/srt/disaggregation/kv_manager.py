"""Per-rank KV handoff managers: the prefill side sends a room's KV, the decode side receives it.

Handshake for one request (room), with the bootstrap server on the prefill node:
1. Each prefill rank registers {host, zmq_port, session, buffers} under its engine rank.
2. The decode rank pre-allocates slots, looks up its peer, and sends a *want* message:
   {room, session, buffers, dst_slots, notify endpoint}.
3. When the room's prefill is done (``PrefillKVManager.send``) and its want has arrived, the prefill
   side copies every buffer's rows (target and draft pools together) and then notifies the decode
   side with the first token and its metadata.
4. The decode side fails a room whose KV does not arrive within the timeout, or whose prefill node
   stops answering, so the scheduler can free the pre-allocated slots.
"""

from __future__ import annotations

import abc
import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import zmq

from sglite.srt.disaggregation.base import (
    SINGLE_RANK,
    KVBufferSpec,
    KVPoll,
    PDRank,
    TransferError,
    plan_copies,
)
from sglite.srt.disaggregation.transfer_backend import TransferBackend

logger = logging.getLogger(__name__)


def _http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _PrefillRoom:
    src_slots: Optional[list[int]] = None
    first_token: Optional[int] = None
    meta: dict[str, Any] = field(default_factory=dict)
    want: Optional[dict[str, Any]] = None
    state: KVPoll = KVPoll.WaitingForInput
    error: str = ""
    created: float = field(default_factory=time.monotonic)


class _RoomEndpoint(abc.ABC):
    """What both sides share: registered KV buffers, a PULL socket for incoming messages, cached
    PUSH sockets to peers, and a lock-guarded table of rooms."""

    def __init__(self, backend: TransferBackend, buffers: Sequence[KVBufferSpec], rank: PDRank,
                 host: str, timeout_s: float) -> None:
        self.backend = backend
        self.buffers = list(buffers)
        self.rank = rank
        self.timeout_s = timeout_s
        backend.register(self.buffers)
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._zmq_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self._push: dict[str, zmq.Socket] = {}
        self._rooms: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []  # background loops that use the sockets

    def error(self, room: int) -> str:
        """Why a room failed."""
        with self._lock:
            r = self._rooms.get(room)
            return r.error if r else ""

    def release(self, room: int) -> None:
        """Forget a room (after success or failure)."""
        with self._lock:
            self._rooms.pop(room, None)

    def close(self) -> None:
        """Stop receiving, let the background loops finish, then close every socket."""
        self._closed = True
        # zmq sockets are not thread-safe: closing the PULL socket while the receive loop polls it
        # (or a PUSH socket mid-send) crashes libzmq, so the loops (<= one 200 ms poll) end first.
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=30)
                if t.is_alive():
                    raise RuntimeError(f"{t.name} did not stop within 30 s; its sockets were left open")
        self._pull.close(linger=0)
        for s in self._push.values():
            s.close(linger=0)

    def _push_json(self, endpoint: str, msg: dict[str, Any]) -> None:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        sock.send_json(msg)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed:
            try:
                if not poller.poll(200):
                    continue
                msg = self._pull.recv_json()
            except zmq.ZMQError:
                return
            self._on_message(msg)

    @abc.abstractmethod
    def _on_message(self, msg: dict[str, Any]) -> None:
        """Handle one message from a peer (a want on the prefill side, a status on the decode side)."""


class PrefillKVManager(_RoomEndpoint):
    """Prefill rank: registers with the bootstrap server and ships finished rooms' KV to decode ranks."""

    def __init__(
        self,
        backend: TransferBackend,
        buffers: Sequence[KVBufferSpec],
        bootstrap_url: str,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        rank: PDRank = SINGLE_RANK,
    ) -> None:
        super().__init__(backend, buffers, rank, host, timeout_s)
        self._work: "queue.Queue[Optional[int]]" = queue.Queue()
        self._register(bootstrap_url, {
            "engine_rank": rank.engine_rank,
            "group_width": rank.group_width,
            "num_groups": rank.num_groups,
            "host": host,
            "zmq_port": self._zmq_port,
            "session": backend.session_id(),
            "buffers": [b.to_wire() for b in self.buffers],
        })
        self._threads = [
            threading.Thread(target=self._recv_loop, name="pd-prefill-recv", daemon=True),
            threading.Thread(target=self._transfer_loop, name="pd-prefill-xfer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    REGISTER_TIMEOUT_S = 30.0

    @classmethod
    def _register(cls, bootstrap_url: str, info: dict[str, Any]) -> None:
        """PUT this rank's route, retrying while engine rank 0 (maybe another process) starts the server."""
        deadline = time.monotonic() + cls.REGISTER_TIMEOUT_S
        while True:
            try:
                _http_json("PUT", f"{bootstrap_url}/route", info)
                return
            except (urllib.error.URLError, OSError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prefill rank {info['engine_rank']} could not register with the bootstrap server at "
                        f"{bootstrap_url} within {cls.REGISTER_TIMEOUT_S:.0f} s ({e})"
                    ) from e
                time.sleep(0.1)

    # --------------------------------------------------------------- scheduler API
    def send(self, room: int, src_slots: Sequence[int], first_token: int, meta: dict[str, Any]) -> None:
        """The room's prefill is done: ship its KV rows once the decode side has asked for them."""
        with self._lock:
            r = self._rooms.setdefault(room, _PrefillRoom())
            r.src_slots, r.first_token, r.meta = [int(s) for s in src_slots], int(first_token), dict(meta)
        self._work.put(room)

    def poll(self, room: int) -> KVPoll:
        """Transfer state of a room; a room whose decode side never asked fails after the timeout."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return KVPoll.Bootstrapping
            if r.state not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - r.created > self.timeout_s:
                r.state, r.error = KVPoll.Failed, f"decode side never asked for room {room}"
            return r.state

    def close(self) -> None:
        """Stop the background threads."""
        self._work.put(None)
        super().close()

    # --------------------------------------------------------------- threads
    def _on_message(self, want: dict[str, Any]) -> None:
        room = int(want["room"])
        with self._lock:
            self._rooms.setdefault(room, _PrefillRoom()).want = want
        self._work.put(room)

    def _transfer_loop(self) -> None:
        while True:
            room = self._work.get()
            if room is None:
                return
            with self._lock:
                r = self._rooms.get(room)
                ready = r is not None and r.want is not None and r.src_slots is not None and r.state == KVPoll.WaitingForInput
                if ready:
                    r.state = KVPoll.Transferring
            if ready:
                self._transfer(room, r)

    def _transfer(self, room: int, r: _PrefillRoom) -> None:
        want = r.want
        status: dict[str, Any] = {"room": room}
        try:
            dst = [KVBufferSpec.from_wire(b) for b in want["buffers"]]
            dst_slots = want["dst_slots"]
            if len(dst_slots) != len(r.src_slots):
                raise TransferError(
                    f"room {room}: decode pre-allocated {len(dst_slots)} slots for {len(r.src_slots)} prompt tokens"
                )
            src_ptrs, dst_ptrs, lengths = plan_copies(self.buffers, dst, r.src_slots, dst_slots)
            self.backend.write(want["session"], src_ptrs, dst_ptrs, lengths)
            status.update(status="success", first_token=r.first_token, meta=r.meta, bytes=sum(lengths))
            state, err = KVPoll.Success, ""
        except (TransferError, KeyError, ValueError) as e:
            status.update(status="failed", error=str(e))
            state, err = KVPoll.Failed, str(e)
        endpoint = want.get("notify")
        if endpoint:
            self._push_json(endpoint, status)
        with self._lock:
            r.state, r.error = state, err


@dataclass
class _DecodeRoom:
    state: KVPoll
    deadline: float
    prefill_health_url: str
    first_token: Optional[int] = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class DecodeKVManager(_RoomEndpoint):
    """Decode rank: asks prefill ranks for rooms' KV into pre-allocated slots, tracks arrival."""

    # A prefill node that stops answering its bootstrap server for this long fails its rooms early.
    PEER_DEAD_AFTER_S = 3.0

    def __init__(
        self,
        backend: TransferBackend,
        buffers: Sequence[KVBufferSpec],
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        rank: PDRank = SINGLE_RANK,
    ) -> None:
        super().__init__(backend, buffers, rank, host, timeout_s)
        self._notify = f"tcp://{host}:{self._zmq_port}"
        self._peer_checked: dict[str, float] = {}  # prefill /health URL -> last probe time
        self._peer_down_since: dict[str, float] = {}  # prefill /health URL -> first failed probe
        self._threads = [threading.Thread(target=self._recv_loop, name="pd-decode-recv", daemon=True)]
        self._threads[0].start()

    def start(self, room: int, bootstrap_host: str, bootstrap_port: int, dst_slots: Sequence[int]) -> None:
        """Ask the paired prefill rank for a room's KV, to be written at dst_slots."""
        base = f"http://{bootstrap_host}:{bootstrap_port}"
        # Register the room before the want goes out: the prefill side may answer before send_json returns.
        with self._lock:
            self._rooms[room] = _DecodeRoom(KVPoll.Transferring, time.monotonic() + self.timeout_s, f"{base}/health")
        try:
            route = self._route(bootstrap_host, bootstrap_port, room)
            self._push_json(
                f"tcp://{route['host']}:{route['zmq_port']}",
                {
                    "room": room,
                    "session": self.backend.session_id(),
                    "buffers": [b.to_wire() for b in self.buffers],
                    "dst_slots": [int(s) for s in dst_slots],
                    "notify": self._notify,
                }
            )
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            with self._lock:
                r = self._rooms[room]
                r.state, r.error = KVPoll.Failed, f"cannot reach the prefill bootstrap server at {base}: {e}"

    def poll(self, room: int) -> KVPoll:
        """Transfer state; times out rooms whose KV never arrives and rooms whose prefill node died."""
        now = time.monotonic()
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return KVPoll.Bootstrapping
            if r.state != KVPoll.Transferring:
                return r.state
            if now > r.deadline:
                r.state, r.error = KVPoll.Failed, f"KV for room {room} did not arrive within {self.timeout_s:.0f}s"
                return r.state
            url = r.prefill_health_url
            check = now - self._peer_checked.get(url, 0.0) > 1.0
        if check:  # at most one /health probe per prefill node per second, shared by all its rooms
            alive = self._peer_alive(url)
            with self._lock:
                self._peer_checked[url] = now
                if alive:
                    self._peer_down_since.pop(url, None)
                else:
                    self._peer_down_since.setdefault(url, now)
        with self._lock:
            down_since = self._peer_down_since.get(url)
            if down_since is not None and now - down_since > self.PEER_DEAD_AFTER_S and r.state == KVPoll.Transferring:
                r.state, r.error = KVPoll.Failed, f"prefill node stopped answering ({url})"
            return r.state

    def result(self, room: int) -> tuple[int, dict[str, Any]]:
        """First token and metadata of a room that reached Success."""
        with self._lock:
            r = self._rooms[room]
            if r.state != KVPoll.Success:
                raise TransferError(f"room {room} is {r.state.name}: {r.error}")
            return int(r.first_token), dict(r.meta)


    def _route(self, host: str, port: int, room: int) -> dict[str, Any]:
        # Looked up per room, not cached: a restarted prefill node re-registers with new endpoints. The server
        # picks the prefill rank of the room's group that matches this rank's place in its own group.
        return _http_json("GET", f"http://{host}:{port}/route?room={int(room)}&rank_in_group={self.rank.rank_in_group}")

    @staticmethod
    def _peer_alive(url: str) -> bool:
        try:
            _http_json("GET", url, timeout=1.0)
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _on_message(self, msg: dict[str, Any]) -> None:
        room = int(msg["room"])
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.state != KVPoll.Transferring:
                return  # a room we already timed out or released
            if msg.get("status") == "success":
                r.state, r.first_token, r.meta = KVPoll.Success, msg["first_token"], msg.get("meta", {})
            else:
                r.state, r.error = KVPoll.Failed, msg.get("error", "prefill reported a failure")
