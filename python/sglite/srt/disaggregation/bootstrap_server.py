"""Bootstrap server on the prefill node: prefill ranks register, decode ranks look their peer up.

Routes (JSON): PUT /route registers one prefill rank {engine_rank, group_width, num_groups, host, zmq_port,
session, buffers}; GET /route?engine_rank=N returns it, and GET /route?room=R&rank_in_group=r returns the rank
of the group serving room R (``room % num_groups``) at place r (404 until registered); GET /health answers 200.
It is a small threaded stdlib HTTP server so it can run beside the scheduler without an event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

from sglite.srt.disaggregation.base import TransferError, prefill_peer_rank

logger = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, fmt: str, *args: Any) -> None:  # route through logging, not stderr
        logger.debug("bootstrap: " + fmt, *args)

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        url = urlparse(self.path)
        if url.path == "/health":
            self._reply(200, {"status": "ok"})
            return
        if url.path == "/route":
            q = parse_qs(url.query)
            try:
                if "room" in q:
                    rank = self._room_peer(int(q["room"][0]), int(q.get("rank_in_group", ["0"])[0]))
                else:
                    rank = int(q.get("engine_rank", ["0"])[0])
            except ValueError as e:
                self._reply(400, {"error": f"room, rank_in_group and engine_rank must be integers ({e})"})
                return
            except TransferError as e:
                self._reply(400, {"error": str(e)})
                return
            if rank is None:
                self._reply(404, {"error": "no prefill rank has registered yet"})
                return
            with self.server.lock:
                info = self.server.routes.get(rank)
            if info is None:
                self._reply(404, {"error": f"prefill engine rank {rank} has not registered"})
            else:
                self._reply(200, info)
            return
        self._reply(404, {"error": f"unknown route {url.path}"})

    def _room_peer(self, room: int, rank_in_group: int) -> Optional[int]:
        """The engine rank of the prefill group serving ``room`` at ``rank_in_group`` (None before any registration)."""
        with self.server.lock:
            any_route = next(iter(self.server.routes.values()), None)
        if any_route is None:
            return None
        return prefill_peer_rank(room, rank_in_group, int(any_route.get("group_width", 1)),
                                 int(any_route.get("num_groups", 1)))

    def do_PUT(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/route":
            self._reply(404, {"error": "unknown route"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            info = json.loads(self.rfile.read(length))
            rank = int(info["engine_rank"])
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            self._reply(400, {"error": f"bad registration: {e}"})
            return
        with self.server.lock:
            self.server.routes[rank] = info
        self._reply(200, {"status": "registered"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, _Handler)
        self.lock = threading.Lock()
        self.routes: dict[int, dict[str, Any]] = {}


class BootstrapServer:
    """Runs the bootstrap HTTP server in a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        try:
            self._server = _Server((host, port))
        except OSError as e:
            raise RuntimeError(
                f"cannot start the PD bootstrap server on {host}:{port} ({e}); "
                "change --disaggregation-bootstrap-port"
            ) from e
        self.port = self._server.server_address[1]
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._server.serve_forever, name="pd-bootstrap", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
