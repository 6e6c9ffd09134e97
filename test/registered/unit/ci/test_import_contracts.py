"""The layering is checked: `lint-imports` keeps every contract in .importlinter, no module-level import
cycle exists, no module is over 500 lines unless docs/architecture.md says why, and an upward import
injected into a copy of the package breaks the layers contract (so the check bites)."""

import os
import re
import shutil
import subprocess
import sys

import grimp

SUITE = "unit-cpu"
EST_TIME = 5

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
PYTHON = os.path.join(REPO, "python")
MAX_LINES = 500


def _lint_imports(python_path: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    return subprocess.run(
        [exe, "--config", os.path.join(REPO, ".importlinter"), "--no-cache"], capture_output=True, text=True,
        timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": python_path},
    )


def test_every_import_contract_is_kept():
    out = _lint_imports(PYTHON)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    copy = tmp_path / "python"
    shutil.copytree(os.path.join(PYTHON, "sglite"), copy / "sglite", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    paging = copy / "sglite" / "srt" / "mem_cache" / "paging.py"
    paging.write_text(paging.read_text() + "\nfrom sglite.srt.managers import scheduler  # noqa: E402,F401\n")
    out = _lint_imports(str(copy))
    assert out.returncode != 0
    assert "sglite.srt.mem_cache.paging -> sglite.srt.managers.scheduler" in out.stdout


def _import_cycles() -> list[list[str]]:
    """Strongly connected components (> 1 module) of the module import graph, TYPE_CHECKING imports aside."""
    sys.path.insert(0, PYTHON)
    try:
        graph = grimp.build_graph("sglite", exclude_type_checking_imports=True, cache_dir=None)
    finally:
        sys.path.remove(PYTHON)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has ~110 nodes, recursion depth is small
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle():
    assert _import_cycles() == []


def test_long_modules_are_explained_in_architecture_md():
    with open(os.path.join(REPO, "docs", "architecture.md")) as f:
        explained = set(re.findall(r"`(python/sglite/[\w/]+\.py)`", f.read().split("## Modules over 500 lines", 1)[1]))
    long = set()
    for root, _dirs, files in os.walk(os.path.join(PYTHON, "sglite")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    if sum(1 for _ in f) > MAX_LINES:
                        long.add(os.path.relpath(path, REPO))
    assert long <= explained, f"over {MAX_LINES} lines without a reason in docs/architecture.md: {sorted(long - explained)}"
