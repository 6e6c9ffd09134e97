"""e2e fixtures: a real `python -m sglite.launch_server` on 127.0.0.1 with a tiny model, one per module."""

import os
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx
import pytest

API_KEY = "sk-e2e"
# Small KV budget so slot accounting is visible; threads pinned because the CI box has 2 cores.
SERVER_FLAGS = ["--device", "cpu", "--cpu-kv-cache-budget-mb", "4", "--served-model-name", "tiny"]
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m sglite.launch_server` in a subprocess; output goes to a log file (model_dir None: the default model)."""

    def __init__(self, model_dir: Optional[str], log_path: str, *flags: str, api_key: str = API_KEY, timeout_s: float = 180):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        model_flags = ["--model-path", model_dir] if model_dir is not None else []
        cmd = [sys.executable, "-m", "sglite.launch_server", *model_flags, "--port", str(self.port), *SERVER_FLAGS, *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **CHILD_ENV), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.output()}")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def watch_health_until_exit(self, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Poll /health until the server process exits or ``timeout_s`` passes; whether it ever said 503."""
        deadline = time.monotonic() + timeout_s
        saw_503 = False
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                saw_503 |= httpx.get(self.base + "/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        return saw_503

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen3 (eos = <|im_end|>) with the tiny tokenizer beside it."""
    from sglite.testing.tiny_models import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3")


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """transformers' model of the same checkpoint: the reference."""
    import torch

    from sglite.testing.tiny_models import load_hf_model

    torch.set_num_threads(1)
    return load_hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
