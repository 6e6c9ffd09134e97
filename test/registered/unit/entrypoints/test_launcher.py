"""The launcher's DP layout: rank placement of both DP topologies and per-replica CUDA devices (no processes)."""

import pytest

from sglite.srt.entrypoints.launcher import _replica_cuda_devices, plan_dp_placements
from sglite.srt.server_args import ServerArgs

SUITE = "unit-cpu"
EST_TIME = 1


def test_placements_replicas_and_dp_attention():
    reps = plan_dp_placements(ServerArgs(tp_size=2, dp_size=2), ["tcp://a", "tcp://b"])
    assert [(p.global_rank, p.rank, p.world_size, p.dp_rank, p.is_front, p.dist_init_method) for p in reps] == [
        (0, 0, 2, 0, True, "tcp://a"), (1, 1, 2, 0, False, "tcp://a"),
        (2, 0, 2, 1, True, "tcp://b"), (3, 1, 2, 1, False, "tcp://b"),
    ]
    attn = plan_dp_placements(ServerArgs(tp_size=4, dp_size=2, enable_dp_attention=True), ["tcp://a"])
    assert [(p.rank, p.world_size, p.dp_rank, p.is_front) for p in attn] == [
        (0, 4, 0, True), (1, 4, 0, False), (2, 4, 1, True), (3, 4, 1, False),
    ]
    with pytest.raises(ValueError, match="rendezvous"):
        plan_dp_placements(ServerArgs(dp_size=2), ["tcp://a"])


def test_cuda_replicas_get_disjoint_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6,7")
    assert _replica_cuda_devices(ServerArgs(device="cuda", tp_size=2, dp_size=2)) == ["3,4", "5,6"]
    assert _replica_cuda_devices(ServerArgs(device="cuda", tp_size=2, dp_size=2, enable_dp_attention=True)) is None
    assert _replica_cuda_devices(ServerArgs(device="cpu", dp_size=2)) is None
    with pytest.raises(ValueError, match="needs 6 GPUs but 5"):
        _replica_cuda_devices(ServerArgs(device="cuda", tp_size=3, dp_size=2))


def test_front_end_imports_no_torch():
    """The HTTP front end and the launcher stay torch-free (torch loads only in the scheduler processes)."""
    import subprocess
    import sys

    code = "import sys, sglite.srt.entrypoints.http_server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
