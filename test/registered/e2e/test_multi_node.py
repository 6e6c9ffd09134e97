"""One server over two "nodes" on one box: ``--nnodes 2 --node-rank 0|1`` of a tp 2 dp 2 DP-attention server
(a DeepSeek-V3-architecture target) gives the same tokens as one process with the same flags; when either node
dies, the other exits with a clear error instead of hanging.

Node 0 serves HTTP, runs the tokenizer, detokenizer and DP controller and one scheduler rank; node 1 runs the
other rank, the front of attention-DP group 1, which connects to node 0's controller over TCP.
"""

import os
import signal
import time

import httpx
import pytest
import torch

from conftest import free_port
from pd_cluster import Proc, Server

SUITE = "e2e-cpu"
EST_TIME = 120

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 10
TOPOLOGY = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from sglite.testing.tiny_models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(str(tmp_path_factory.mktemp("mn") / "target"), "deepseek_v3", seed=3,
                            with_tokenizer=True, eos_token_id=None, num_hidden_layers=2)


class WorkerNode(Proc):
    """`python -m sglite.launch_server --node-rank 1`: scheduler ranks only, no HTTP."""

    def __init__(self, name, model_dir, dist_addr, log_dir):
        import sys

        from conftest import SERVER_FLAGS

        super().__init__(name, [sys.executable, "-m", "sglite.launch_server", "--model-path", model_dir,
                                *SERVER_FLAGS, *TOPOLOGY, "--nnodes", "2", "--node-rank", "1",
                                "--dist-init-addr", dist_addr], log_dir)


def _two_nodes(target, logs, tag):
    dist_addr = f"127.0.0.1:{free_port()}"
    node1 = WorkerNode(f"node1_{tag}", target, dist_addr, logs)
    node0 = Server(f"node0_{tag}", ["--model-path", target], logs, *TOPOLOGY, "--nnodes", "2", "--node-rank", "0",
                   "--dist-init-addr", dist_addr)
    return node0, node1


def _generate(base, ids):
    r = httpx.post(base + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _wait_exit(proc: Proc, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            return proc.proc.returncode
        time.sleep(0.5)
    raise AssertionError(f"{proc.name} still running {timeout_s:.0f} s after its peer died:\n{proc.output()}")


def test_two_nodes_equal_one_process_and_a_dead_node_stops_the_other(target, tmp_path):
    procs: list[Proc] = []
    try:
        single = Server("single", ["--model-path", target], tmp_path, *TOPOLOGY)
        node0, node1 = _two_nodes(target, tmp_path, "a")
        procs += [single, node0, node1]
        deadline = time.monotonic() + 300
        single.wait_healthy(deadline)
        node0.wait_healthy(deadline)
        prompts = [[5, 17, 300, 41, 7], [100, 200, 300], list(range(60, 84)), [42, 42, 7]]
        for p in prompts:  # consecutive requests alternate between the two attention-DP groups (round robin)
            assert _generate(node0.base, p) == _generate(single.base, p), p
        ranks = httpx.get(node0.base + "/get_server_info", timeout=30).json()
        assert ranks["nnodes"] == 2 and len(ranks["ranks"]) == 1  # node 0 runs one of the two ranks
        assert "node 1 of 2: scheduler ranks [1] ready" in node1.output()

        # Node 1 dies: node 0's ranks lose their collective peer, and the server exits with the reason.
        os.killpg(node1.proc.pid, signal.SIGKILL)
        assert _wait_exit(node0, 90) == 1
        assert "exited unexpectedly" in node0.output()

        # Node 0 dies: node 1 stops its rank and exits 1, naming the rank that went first.
        node0b, node1b = _two_nodes(target, tmp_path, "b")
        procs += [node0b, node1b]
        node0b.wait_healthy(time.monotonic() + 300)
        assert _generate(node0b.base, prompts[0]) == _generate(single.base, prompts[0])
        os.killpg(node0b.proc.pid, signal.SIGKILL)
        assert _wait_exit(node1b, 90) == 1
        assert "stopping this node" in node1b.output()
    finally:
        for p in procs:
            p.stop()


def test_node_flags_are_checked_before_anything_starts(target):
    import subprocess
    import sys

    def launch(*flags):
        return subprocess.run([sys.executable, "-m", "sglite.launch_server", "--model-path", target, *flags],
                              capture_output=True, text=True, timeout=60)

    r = launch("--nnodes", "2", "--tp-size", "2")
    assert r.returncode == 2 and "--dist-init-addr" in r.stderr
    r = launch("--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:5000")
    assert r.returncode == 2 and "--node-rank 2 must be in 0..1" in r.stderr
    r = launch("--nnodes", "2", "--tp-size", "1", "--dp-size", "2", "--dist-init-addr", "127.0.0.1:5000")
    assert r.returncode == 2 and "not DP replicas" in r.stderr
