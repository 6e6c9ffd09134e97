#!/usr/bin/env python3
"""Parse a PR comment's ``/rerun-test`` commands into runs (file, selector, runner) for rerun-test.yml.

Syntax, one command per line:

    /rerun-test <test file>[::Class[::test]] [runner label]

The file must be a registered test file (``test/registered/**/test_*.py`` with a SUITE; the
``test/registered/`` prefix may be omitted). The runner defaults to ``ubuntu-latest`` for CPU suites
and ``1-gpu-h100`` for the gpu suite; a gpu-suite file needs a GPU runner. Anything else is
rejected with a message that says what to write instead.

    python scripts/ci/rerun_test.py --comment "/rerun-test unit/test_server_args.py"
    python scripts/ci/rerun_test.py --comment-env COMMENT --github-output "$GITHUB_OUTPUT"

With ``--github-output`` it appends ``matrix=<json>`` (for ``strategy.matrix``) and ``summary=<text>``,
or ``error=<text>`` on a rejected comment; the exit status is 0 for accepted runs, 1 for a rejection.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
COMMAND = "/rerun-test"
MAX_RUNS = 8

# Runner label -> the `runs-on` value of the job that runs it.
RUNNERS: dict[str, list[str]] = {
    "ubuntu-latest": ["ubuntu-latest"],
    "1-gpu-h100": ["self-hosted", "1-gpu-h100"],
    "2-gpu": ["self-hosted", "2-gpu"],
}
GPU_RUNNERS = ("1-gpu-h100", "2-gpu")
DEFAULT_RUNNER = {"unit-cpu": "ubuntu-latest", "e2e-cpu": "ubuntu-latest", "gpu": "1-gpu-h100"}

# pytest node-id parts: Python identifiers, optionally with a parametrize id of safe characters.
_NODE_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[A-Za-z0-9_.,=+\-]*\])?$")
_FILE = re.compile(r"^[A-Za-z0-9_./\-]+\.py$")


class RerunRequestError(ValueError):
    """A /rerun-test command that cannot run; the message says why and what to write instead."""


@dataclass(frozen=True)
class RerunRun:
    """One test file (optionally one class/test in it) to rerun on one runner."""

    file: str  # repository-relative, e.g. test/registered/unit/test_server_args.py
    selector: str  # "" or "Class", "Class::test", "test"
    runner: str  # runner label
    suite: str

    @property
    def target(self) -> str:
        """The pytest node id."""
        return f"{self.file}::{self.selector}" if self.selector else self.file

    def matrix_entry(self) -> dict[str, object]:
        """One `strategy.matrix.include` entry."""
        d = asdict(self)
        d["target"] = self.target
        d["runs_on"] = RUNNERS[self.runner]
        d["gpu"] = self.runner in GPU_RUNNERS
        return d


def registered_files(repo_root: str = REPO_ROOT) -> dict[str, str]:
    """Registered test file (repository-relative) -> suite, read by test/run_suite.py."""
    spec = importlib.util.spec_from_file_location("_sglite_run_suite", os.path.join(repo_root, "test", "run_suite.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module while the class is built
    spec.loader.exec_module(mod)
    root = os.path.join(repo_root, "test", "registered")
    return {f.path.replace(os.sep, "/"): f.suite for f in mod.discover(root, repo_root)}


def _resolve_file(raw: str, registered: dict[str, str]) -> str:
    if not _FILE.match(raw) or ".." in raw.split("/") or raw.startswith("/"):
        raise RerunRequestError(
            f"{raw!r} is not a test file path; write a path such as test/registered/unit/test_server_args.py"
        )
    for candidate in (raw, f"test/registered/{raw}", f"test/{raw}"):
        if candidate in registered:
            return candidate
    base = os.path.basename(raw)
    close = sorted(p for p in registered if os.path.basename(p) == base)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; registered files live under test/registered/"
    raise RerunRequestError(f"{raw!r} is not a registered test file{hint}")


def _parse_selector(parts: list[str], raw: str) -> str:
    if len(parts) > 2:
        raise RerunRequestError(f"{raw!r}: at most <file>::Class::test")
    for p in parts:
        if not _NODE_PART.match(p):
            raise RerunRequestError(f"{raw!r}: {p!r} is not a test class or function name")
    return "::".join(parts)


def parse_command(line: str, registered: dict[str, str]) -> RerunRun:
    """One `/rerun-test ...` line into a run."""
    words = line.split()
    if not words or words[0] != COMMAND:
        raise RerunRequestError(f"not a {COMMAND} command: {line!r}")
    args = words[1:]
    if not 1 <= len(args) <= 2:
        raise RerunRequestError(f"usage: {COMMAND} <test file>[::Class[::test]] [runner label] (got {line.strip()!r})")
    file_part, *selector_parts = args[0].split("::")
    file = _resolve_file(file_part, registered)
    selector = _parse_selector(selector_parts, args[0])
    suite = registered[file]
    runner = args[1] if len(args) == 2 else DEFAULT_RUNNER[suite]
    if runner not in RUNNERS:
        raise RerunRequestError(f"unknown runner {runner!r}; choose one of {', '.join(RUNNERS)}")
    if suite == "gpu" and runner not in GPU_RUNNERS:
        raise RerunRequestError(f"{file} is in the gpu suite; run it on {' or '.join(GPU_RUNNERS)}, not {runner}")
    return RerunRun(file=file, selector=selector, runner=runner, suite=suite)


def parse_comment(text: str, registered: Optional[dict[str, str]] = None) -> list[RerunRun]:
    """Every `/rerun-test` line of a comment; raises RerunRequestError naming every bad line."""
    registered = registered_files() if registered is None else registered
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().split(" ", 1)[0] == COMMAND]
    if not lines:
        raise RerunRequestError(f"no {COMMAND} command in the comment")
    if len(lines) > MAX_RUNS:
        raise RerunRequestError(f"{len(lines)} {COMMAND} commands; at most {MAX_RUNS} per comment")
    runs, errors = [], []
    for ln in lines:
        try:
            runs.append(parse_command(ln, registered))
        except RerunRequestError as e:
            errors.append(str(e))
    if errors:
        raise RerunRequestError("; ".join(errors))
    return list(dict.fromkeys(runs))  # drop exact duplicates, keep order


def _write_output(path: str, key: str, value: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        if "\n" in value:
            f.write(f"{key}<<__SGLITE_EOF__\n{value}\n__SGLITE_EOF__\n")
        else:
            f.write(f"{key}={value}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--comment", help="the comment text")
    src.add_argument("--comment-env", help="name of the environment variable holding the comment")
    parser.add_argument("--github-output", help="append matrix/summary/error to this file ($GITHUB_OUTPUT)")
    args = parser.parse_args(argv)
    text = args.comment if args.comment is not None else os.environ.get(args.comment_env, "")
    try:
        runs = parse_comment(text)
    except RerunRequestError as e:
        print(f"rerun-test: {e}", file=sys.stderr)
        if args.github_output:
            _write_output(args.github_output, "error", str(e))
        return 1
    matrix = {"include": [r.matrix_entry() for r in runs]}
    summary = "\n".join(f"- `{r.target}` on `{r.runner}`" for r in runs)
    print(json.dumps(matrix, indent=2))
    if args.github_output:
        _write_output(args.github_output, "matrix", json.dumps(matrix))
        _write_output(args.github_output, "summary", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
