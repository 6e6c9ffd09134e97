"""Fixtures: an HTTP server whose scheduler is the fake_scheduler test double (no model needed)."""

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
API_KEY = "sk-test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """A running `launch_server` with the fake scheduler, in a subprocess."""

    def __init__(self, tokenizer_dir: str, *extra: str, api_key=API_KEY):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        argv = ["--model-path", tokenizer_dir, "--port", str(self.port), "--served-model-name", "tiny", *extra]
        if api_key:
            argv += ["--api-key", api_key]
        code = f"import sys; sys.path.insert(0, {HERE!r}); import fake_scheduler; sys.exit(fake_scheduler.main(sys.argv[1:]))"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy within 60 s")

    @property
    def headers(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.stdout.read()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from sglite.testing.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def fake_server(tokenizer_dir):
    server = FakeServer(tokenizer_dir, "--enable-metrics")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def make_fake_server(tokenizer_dir):
    """FakeServer(tokenizer_dir, *extra_flags) for this module's own flags; stopped at module end."""
    servers = []

    def make(*extra: str) -> FakeServer:
        servers.append(FakeServer(tokenizer_dir, *extra))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()
