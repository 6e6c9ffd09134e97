#!/usr/bin/env python3
"""Run one test suite (unit-cpu | e2e-cpu | gpu), optionally one time-balanced partition of it.

Every ``test/registered/**/test_*.py`` declares at module top ``SUITE = "<suite>"`` and
``EST_TIME = <seconds>``; both are read with ``ast`` (nothing is imported), and a file without them
is an error, so no test file is silently left out of CI. Each file runs in its own pytest process
(isolation: process-wide state such as the runtime context and torch.distributed cannot leak between
files). Exit status: 0 when every selected file passed, 1 otherwise, 2 for a registration error.

    python test/run_suite.py --suite unit-cpu
    python test/run_suite.py --suite gpu --partition-id 0 --partition-count 2
    python test/run_suite.py --suite unit-cpu e2e-cpu --list
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Optional, Sequence

SUITES = ("unit-cpu", "e2e-cpu", "gpu")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
DEFAULT_ROOT = os.path.join(HERE, "registered")
PYTEST_NO_TESTS_COLLECTED = 5


class RegistrationError(ValueError):
    """A test file that does not declare a valid SUITE / EST_TIME."""


@dataclass(frozen=True)
class RegisteredFile:
    """One registered test file."""

    path: str  # relative to the repository root
    suite: str
    est_time: float


@dataclass
class FileResult:
    """Outcome of running one file."""

    file: RegisteredFile
    status: str  # passed | failed | no-tests | timeout
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)


def _module_constants(source: str, filename: str) -> dict[str, object]:
    """Literal values of top-level ``NAME = <literal>`` assignments."""
    tree = ast.parse(source, filename=filename)
    out: dict[str, object] = {}
    for node in tree.body:
        targets: list[ast.expr] = []
        value: Optional[ast.expr] = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if isinstance(t, ast.Name) and t.id in ("SUITE", "EST_TIME"):
                try:
                    out[t.id] = ast.literal_eval(value)
                except ValueError:
                    raise RegistrationError(f"{filename}: {t.id} must be a literal, not an expression") from None
    return out


def read_registration(path: str, repo_root: str) -> RegisteredFile:
    """SUITE and EST_TIME of one file, validated."""
    rel = os.path.relpath(path, repo_root)
    with open(path, encoding="utf-8") as f:
        consts = _module_constants(f.read(), rel)
    if "SUITE" not in consts:
        raise RegistrationError(f"{rel}: no SUITE = \"unit-cpu\" | \"e2e-cpu\" | \"gpu\" at module top")
    suite = consts["SUITE"]
    if suite not in SUITES:
        raise RegistrationError(f"{rel}: SUITE {suite!r} is not one of {list(SUITES)}")
    if "EST_TIME" not in consts:
        raise RegistrationError(f"{rel}: no EST_TIME = <seconds> at module top")
    est = consts["EST_TIME"]
    if isinstance(est, bool) or not isinstance(est, (int, float)) or est <= 0:
        raise RegistrationError(f"{rel}: EST_TIME must be a positive number of seconds, got {est!r}")
    return RegisteredFile(path=rel, suite=str(suite), est_time=float(est))


def discover(root: str = DEFAULT_ROOT, repo_root: Optional[str] = None) -> list[RegisteredFile]:
    """Every registered test file under ``root``; raises RegistrationError listing every bad file."""
    repo_root = repo_root or REPO_ROOT
    files, errors = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        for name in sorted(filenames):
            if name.startswith("test_") and name.endswith(".py"):
                try:
                    files.append(read_registration(os.path.join(dirpath, name), repo_root))
                except (RegistrationError, SyntaxError) as e:
                    errors.append(str(e))
    if errors:
        raise RegistrationError("unregistered test files:\n  " + "\n  ".join(errors))
    return sorted(files, key=lambda f: f.path)


def partition(files: Sequence[RegisteredFile], partition_id: int, partition_count: int) -> list[RegisteredFile]:
    """Greedy longest-first split into ``partition_count`` parts of balanced estimated time; returns one."""
    if partition_count < 1 or not 0 <= partition_id < partition_count:
        raise ValueError(f"--partition-id {partition_id} must be in [0, --partition-count {partition_count})")
    loads = [0.0] * partition_count
    parts: list[list[RegisteredFile]] = [[] for _ in range(partition_count)]
    for f in sorted(files, key=lambda f: (-f.est_time, f.path)):
        i = min(range(partition_count), key=lambda k: (loads[k], k))
        parts[i].append(f)
        loads[i] += f.est_time
    return sorted(parts[partition_id], key=lambda f: f.path)


def _junit_counts(xml_path: str) -> dict[str, int]:
    if not os.path.isfile(xml_path):
        return {}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_file(
    f: RegisteredFile, repo_root: str, pytest_args: Sequence[str], file_timeout: Optional[float] = None
) -> FileResult:
    """Run one file in its own pytest process, streaming its output."""
    timeout = file_timeout if file_timeout is not None else max(300.0, 10.0 * f.est_time)
    with tempfile.TemporaryDirectory(prefix="run_suite_") as tmp:
        xml = os.path.join(tmp, "junit.xml")
        # -rs: every skip prints its reason (e.g. which system package to install).
        cmd = [sys.executable, "-m", "pytest", f.path, "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        cmd += list(pytest_args)
        print(f"\n=== {f.path} (suite {f.suite}, est {f.est_time:.0f} s)", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, cwd=repo_root, env=env, timeout=timeout, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            return FileResult(f, "timeout", time.monotonic() - t0, _junit_counts(xml))
        seconds = time.monotonic() - t0
        counts = _junit_counts(xml)
    if rc == 0:
        status = "passed"
    elif rc == PYTEST_NO_TESTS_COLLECTED:
        # A registered file that collects nothing was dropped by mistake, unless a filter (-k, -m) chose that.
        status = "no-tests"
    else:
        status = "failed"
    return FileResult(f, status, seconds, counts)


def print_table(results: Sequence[FileResult]) -> None:
    """Per-file summary: status, tests passed/failed/skipped, actual vs estimated seconds."""
    width = max([len(r.file.path) for r in results] + [4])
    print("\n" + "=" * (width + 52))
    print(f"{'file':<{width}}  {'status':<8} {'pass':>5} {'fail':>5} {'skip':>5} {'secs':>7} {'est':>6}")
    for r in results:
        c = r.counts
        fails = c.get("failures", 0) + c.get("errors", 0) if c else 0
        print(
            f"{r.file.path:<{width}}  {r.status:<8} {c.get('passed', 0):>5} {fails:>5} {c.get('skipped', 0):>5} "
            f"{r.seconds:>7.1f} {r.file.est_time:>6.0f}"
        )
    total = sum(r.seconds for r in results)
    passed, skipped = (sum(r.counts.get(k, 0) for r in results) for k in ("passed", "skipped"))
    failed = sum(r.counts.get("failures", 0) + r.counts.get("errors", 0) for r in results)
    print(f"{len(results)} files, {passed} passed, {failed} failed, {skipped} skipped, {total:.1f} s")


def write_json(path: str, results: Sequence[FileResult], label: str, ok: bool) -> None:
    """Per-file results as JSON (used by scripts/gpu_check.sh)."""
    payload = {
        "selection": label,
        "ok": ok,
        "files": [
            {"path": r.file.path, "suite": r.file.suite, "status": r.status, "seconds": round(r.seconds, 2),
             "est_time": r.file.est_time, **r.counts}
            for r in results
        ],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", nargs="+", required=True, choices=SUITES)
    parser.add_argument("--partition-id", type=int, default=0)
    parser.add_argument("--partition-count", type=int, default=1)
    parser.add_argument("--list", action="store_true", help="list the selected files and exit")
    parser.add_argument("--root", default=DEFAULT_ROOT, help="directory of registered tests")
    parser.add_argument("--fail-fast", action="store_true", help="stop after the first failing file")
    parser.add_argument("--file-timeout", type=float, default=None, help="seconds per file (default max(300, 10 x EST_TIME))")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the per-file results as JSON here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    root = os.path.abspath(args.root)
    # Paths are relative to the repository root (where pytest runs), or to --root's parent elsewhere.
    repo_root = REPO_ROOT if root.startswith(REPO_ROOT + os.sep) else os.path.dirname(root)
    try:
        files = discover(root, repo_root)
        selected = partition([f for f in files if f.suite in args.suite], args.partition_id, args.partition_count)
    except (RegistrationError, ValueError) as e:
        print(f"run_suite: error: {e}", file=sys.stderr)
        return 2
    label = f"suite {'+'.join(args.suite)}, partition {args.partition_id}/{args.partition_count}"
    if args.list:
        for f in selected:
            print(f"{f.est_time:>6.0f}  {f.suite:<8}  {f.path}")
        print(f"{len(selected)} files, {sum(f.est_time for f in selected):.0f} s estimated ({label})")
        return 0
    if not selected:
        print(f"run_suite: no registered files in {label}; nothing to run")
        return 0
    filtered = any(a in ("-k", "-m") or a.startswith(("-k", "-m", "--deselect")) or "::" in a for a in args.pytest_args)
    results = []
    # One throwaway cache for the run (GGUF metadata folders), shared by every file's process.
    cache = tempfile.TemporaryDirectory(prefix="sglite_test_cache_")
    os.environ.setdefault("SGLITE_CACHE_DIR", cache.name)
    for f in selected:
        r = run_file(f, repo_root, args.pytest_args, args.file_timeout)
        if r.status == "no-tests" and filtered:
            r.status = "filtered"
        results.append(r)
        if args.fail_fast and r.status not in ("passed", "filtered"):
            break
    print_table(results)
    bad = [r for r in results if r.status not in ("passed", "filtered")]
    if args.json_out:
        write_json(args.json_out, results, label, ok=not bad)
    if bad:
        print(f"FAILED ({label}): " + ", ".join(f"{r.file.path} [{r.status}]" for r in bad))
        return 1
    print(f"OK ({label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
