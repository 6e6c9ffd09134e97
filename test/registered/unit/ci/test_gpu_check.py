"""scripts/gpu_check.sh: --dry-run lists every step within the 8-minute budget, on a CPU host."""

import os
import re
import subprocess

import pytest

SUITE = "unit-cpu"
EST_TIME = 15

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")
STEPS = ("environment", "gpu-tests", "attention-bandwidth", "decode-throughput", "dflash-speedup", "cuda-graph-decode")


def _run(*args, env=None):
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(60)
def test_dry_run_lists_every_step_within_budget(tmp_path):
    proc = _run("--dry-run", env={"OUT": str(tmp_path / "out")})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    budgets = {}
    for name in STEPS:
        m = re.search(rf"^\s+{re.escape(name)}\s+(\d+)s\s+(.*)$", out, re.M)
        assert m, f"step {name} missing from:\n{out}"
        budgets[name] = int(m.group(1))
        rest = m.group(2)
        script = {"attention-bandwidth": "benchmark/bench_attention.py", "decode-throughput": "benchmark/bench_one_batch.py",
                  "dflash-speedup": "benchmark/bench_spec.py", "cuda-graph-decode": "benchmark/bench_cuda_graph.py"}.get(name)
        if script is not None:
            # Either it would run the script, or it says which file is missing.
            if os.path.isfile(os.path.join(REPO, script)):
                assert script in rest and "SKIP" not in rest
                # JSON goes to $OUT through the script's own whole flag, never an argparse abbreviation.
                m_flag = re.search(r"(--[a-z-]+) \"?" + re.escape(str(tmp_path / "out")), rest)
                if m_flag:
                    with open(os.path.join(REPO, script)) as f:
                        assert f'"{m_flag.group(1)}"' in f.read()
            else:
                assert rest.startswith("SKIP") and script in rest
    assert sum(budgets.values()) <= 480
    assert f"total budget: {sum(budgets.values())}s" in out
    assert str(tmp_path / "out") in out  # results go under $OUT
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    assert "--suite gpu" in out


@pytest.mark.timeout(60)
def test_skip_tests_and_bad_arguments():
    assert re.search(r"gpu-tests\s+\d+s\s+SKIP \(--skip-tests given\)", _run("--dry-run", "--skip-tests").stdout)
    bad = _run("--bogus")
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


@pytest.mark.timeout(120)
def test_real_run_refuses_a_host_without_cuda(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA; the refusal path is for CPU hosts")
    python = os.path.join(REPO, ".venv", "bin", "python")
    proc = _run(env={"OUT": str(tmp_path / "o"), "PYTHON": python if os.path.exists(python) else "python3"})
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
