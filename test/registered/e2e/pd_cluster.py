"""A PD cluster on 127.0.0.1 for e2e tests: server and router processes, each in its own session, logging to files."""

import os
import signal
import subprocess
import sys
import time

import httpx

from conftest import CHILD_ENV, SERVER_FLAGS, free_port


class Proc:
    """A child process in its own session (so the whole server tree can be SIGKILLed), logging to a file."""

    def __init__(self, name: str, cmd: list[str], log_dir) -> None:
        self.name = name
        self.log_path = str(log_dir / f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **CHILD_ENV), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class Server(Proc):
    """`python -m sglite.launch_server` (not waited for: call wait_healthy)."""

    def __init__(self, name: str, model_flags: list[str], log_dir, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [sys.executable, "-m", "sglite.launch_server", "--port", str(self.port),
                                *SERVER_FLAGS, *model_flags, *flags], log_dir)

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy in time:\n{self.output()}")

    def state(self) -> dict:
        return httpx.get(self.base + "/get_server_info", timeout=30).json()["internal_states"][0]


class Router(Proc):
    """sglang-router in PD mode in front of one prefill node and one decode node."""

    def __init__(self, name: str, prefill: Server, bootstrap_port: int, decode: Server, log_dir) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                "--prefill", prefill.base, str(bootstrap_port), "--decode", decode.base,
                                "--host", "127.0.0.1", "--port", str(self.port),
                                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())], log_dir)

    def wait_serving(self, deadline: float) -> None:
        """Until a request goes through (workers register asynchronously)."""
        while True:
            try:
                r = httpx.post(self.base + "/generate", timeout=60,
                               json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} does not serve:\n{self.output()}")
            time.sleep(0.5)
