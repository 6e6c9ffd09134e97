"""The docs and the package say what the project is today: no development-history notes, no machine paths.

- README.md, docs/**/*.md and python/** (.py, .cpp) never name a development session by number (the word "session"
  followed by a number) and never hold a path under the development machine's work or tmp directories (tests use
  pytest's ``tmp_path``; examples use ``mktemp``).
- docs/benchmarks.md is a results page: at most 400 lines, and no table row over 300 characters.
- Links into a doc's headings resolve: ``[...](benchmarks.md#anchor)`` names a heading's anchor, and a citation such
  as ``docs/benchmarks.md, "CPU pinning"`` names the start of one of that doc's headings.
"""

import re
from pathlib import Path

import pytest

SUITE = "unit-cpu"
EST_TIME = 2

REPO = Path(__file__).resolve().parents[3]

SESSION = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|tmp)/")
# Examples for the patterns, assembled so that a grep of the tree for either finds nothing here.
_S, _W, _T = "Session", "/" + "work" + "/", "/" + "tmp" + "/"
BENCHMARKS_MAX_LINES = 400
TABLE_ROW_MAX_CHARS = 300


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _package_sources() -> list[Path]:
    files = sorted(p for ext in ("*.py", "*.cpp") for p in (REPO / "python").rglob(ext))
    return [p for p in files if "egg-info" not in _rel(p)]


def _hits(paths: list[Path], pattern: re.Pattern) -> list[str]:
    hits = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            hits.append(f"{_rel(path)}:{line}: {m.group(0)!r}")
    return hits


@pytest.mark.parametrize("pattern", [SESSION, MACHINE_PATH], ids=["session-number", "machine-path"])
def test_docs_and_package_hold_no_history_notes_or_machine_paths(pattern):
    assert not _hits(_docs() + _package_sources(), pattern)


def test_the_patterns_catch_what_they_are_for():
    assert SESSION.search(f"measured in {_S} 17") and SESSION.search(f"{_S.lower()}s 17-24")
    assert SESSION.search(f"{_S.lower()}\n9")
    assert not SESSION.search("one session of Mooncake") and not SESSION.search("a session-scoped fixture")
    assert MACHINE_PATH.search(f"see {_W}venvs/vllm") and MACHINE_PATH.search(f"(`{_T}x`)")
    assert not MACHINE_PATH.search("$TMPDIR/sglite") and not MACHINE_PATH.search(f"http://host{_T}x")


def test_benchmarks_page_is_short_with_one_line_table_rows():
    lines = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, f"docs/benchmarks.md has {len(lines)} lines"
    long_rows = [i + 1 for i, line in enumerate(lines) if line.startswith("|") and len(line) > TABLE_ROW_MAX_CHARS]
    assert not long_rows, f"table rows over {TABLE_ROW_MAX_CHARS} characters at lines {long_rows}"


def _headings(path: Path) -> list[str]:
    headings, fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            headings.append(line.lstrip("#").strip())
    return headings


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_links_to_headings_resolve():
    broken = []
    for doc in _docs():
        text = doc.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)#([\w-]+)\)", text):
            path = (doc.parent / target).resolve()
            if not path.exists() or anchor not in {_anchor(h) for h in _headings(path)}:
                broken.append(f"{_rel(doc)}: {target}#{anchor}")
    assert not broken


def test_cited_sections_exist():
    docs = {p.name: p for p in _docs()}
    broken = []
    for path in _docs() + _package_sources():
        text = path.read_text(encoding="utf-8")
        # One line per comment or docstring line: drop comment markers so a citation may wrap.
        text = re.sub(r"\s+", " ", re.sub(r"(?m)^\s*(#|//)", " ", text))
        for name, section in re.findall(r"([\w-]+\.md), \"([^\"]+)\"", text):
            if name in docs and not any(h.startswith(section) for h in _headings(docs[name])):
                broken.append(f"{_rel(path)}: {name}, {section!r}")
    assert not broken
