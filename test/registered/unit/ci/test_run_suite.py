"""test/run_suite.py: registration via ast, time partitions, exit status and the per-file table."""

import os
import textwrap

import pytest

from sglite.testing.scripts import load_script

SUITE = "unit-cpu"
EST_TIME = 25

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
run_suite = load_script(os.path.join(REPO, "test", "run_suite.py"))


def _write(root, rel, body):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def test_every_file_in_this_repository_is_registered():
    files = run_suite.discover()
    assert files, "no registered test files found"
    me = [f for f in files if f.path.endswith("unit/ci/test_run_suite.py")]
    assert me and me[0].suite == "unit-cpu" and me[0].est_time == EST_TIME
    assert {f.suite for f in files} <= set(run_suite.SUITES)
    # test/registered has no __init__.py files, so plain `pytest` (pyproject testpaths) needs unique basenames.
    names = [os.path.basename(f.path) for f in files]
    dupes = sorted({f.path for f in files if names.count(os.path.basename(f.path)) > 1})
    assert not dupes, f"test files share a basename (plain pytest would fail with 'import file mismatch'): {dupes}"


def test_missing_suite_is_an_error_naming_the_file(tmp_path):
    _write(tmp_path, "a/test_ok.py", 'SUITE = "unit-cpu"\nEST_TIME = 1\n')
    _write(tmp_path, "b/test_forgot.py", "EST_TIME = 3\ndef test_x():\n    pass\n")
    with pytest.raises(run_suite.RegistrationError, match="test_forgot.py: no SUITE"):
        run_suite.discover(str(tmp_path), str(tmp_path))


@pytest.mark.parametrize(
    "body,message",
    [
        ('SUITE = "cpu"\nEST_TIME = 1\n', "not one of"),
        ('SUITE = "gpu"\n', "no EST_TIME"),
        ('SUITE = "gpu"\nEST_TIME = 2 * 3\n', "literal"),
        ('SUITE = "gpu"\nEST_TIME = 0\n', "positive"),
    ],
)
def test_bad_registrations(tmp_path, body, message):
    _write(tmp_path, "test_bad.py", body)
    with pytest.raises(run_suite.RegistrationError, match=message):
        run_suite.discover(str(tmp_path), str(tmp_path))


def test_registration_is_read_without_importing(tmp_path):
    # Importing this file would raise; ast reading must not.
    _write(tmp_path, "test_heavy.py", 'SUITE: str = "gpu"\nEST_TIME = 42.5\nraise SystemExit("imported!")\n')
    (f,) = run_suite.discover(str(tmp_path), str(tmp_path))
    assert (f.path, f.suite, f.est_time) == ("test_heavy.py", "gpu", 42.5)


def test_partitions_cover_every_file_once_and_balance_time():
    files = [run_suite.RegisteredFile(f"t{i}.py", "unit-cpu", est) for i, est in enumerate([50, 40, 30, 20, 10, 10, 5, 5, 1])]
    for n in (1, 2, 3, 4):
        parts = [run_suite.partition(files, i, n) for i in range(n)]
        flat = sorted(f.path for p in parts for f in p)
        assert flat == sorted(f.path for f in files)
        loads = [sum(f.est_time for f in p) for p in parts]
        assert max(loads) - min(loads) <= max(f.est_time for f in files)
    assert [sum(f.est_time for f in run_suite.partition(files, i, 2)) for i in range(2)] == [86.0, 85.0]
    with pytest.raises(ValueError, match="partition"):
        run_suite.partition(files, 2, 2)


@pytest.mark.timeout(120)
def test_main_runs_files_and_reports_failures(tmp_path, capsys):
    root = tmp_path / "registered"
    _write(root, "test_pass.py", 'SUITE = "unit-cpu"\nEST_TIME = 1\ndef test_a():\n    assert 1 + 1 == 2\n')
    _write(root, "test_fail.py", 'SUITE = "unit-cpu"\nEST_TIME = 1\ndef test_b():\n    assert 1 + 1 == 3\n')
    _write(root, "test_empty.py", 'SUITE = "unit-cpu"\nEST_TIME = 1\n')
    _write(root, "test_gpu_only.py", 'SUITE = "gpu"\nEST_TIME = 1\ndef test_c():\n    assert False\n')
    _write(root, "test_skip.py", 'import pytest\nSUITE = "unit-cpu"\nEST_TIME = 1\n'
           '@pytest.mark.skip(reason="needs libfoo: apt-get install libfoo")\ndef test_d():\n    pass\n')
    assert run_suite.main(["--suite", "unit-cpu", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    table = out[out.index("file ") :]
    assert "test_pass.py" in table and "test_gpu_only.py" not in table
    rows = {
        os.path.basename(line.split()[0]): line.split()[1:]
        for line in table.splitlines()
        if line.startswith("registered/test_")
    }
    assert rows["test_pass.py"][:3] == ["passed", "1", "0"]
    assert rows["test_fail.py"][:3] == ["failed", "0", "1"]
    assert rows["test_empty.py"][0] == "no-tests"  # a registered file with no tests is a failure
    # A skip passes and is counted in its row and in the total (pytest -rs prints its reason).
    assert rows["test_skip.py"][:4] == ["passed", "0", "0", "1"]
    assert "4 files, 1 passed, 1 failed, 1 skipped" in out
    assert "FAILED" in out and "registered/test_empty.py [no-tests]" in out


@pytest.mark.timeout(120)
def test_main_exit_statuses(tmp_path, capsys):
    root = tmp_path / "registered"
    _write(root, "test_pass.py", 'SUITE = "e2e-cpu"\nEST_TIME = 1\ndef test_a():\n    pass\ndef test_b():\n    pass\n')
    report = tmp_path / "results.json"
    assert run_suite.main(["--suite", "e2e-cpu", "--root", str(root), "--json", str(report)]) == 0
    data = __import__("json").loads(report.read_text())
    assert data["ok"] is True
    assert [(f["path"], f["status"], f["passed"]) for f in data["files"]] == [("registered/test_pass.py", "passed", 2)]
    # A -k filter that deselects everything is not a failure.
    assert run_suite.main(["--suite", "e2e-cpu", "--root", str(root), "--", "-k", "nothing_matches"]) == 0
    # An empty partition is not a failure either.
    assert run_suite.main(["--suite", "gpu", "--root", str(root)]) == 0
    assert run_suite.main(["--suite", "e2e-cpu", "--root", str(root), "--list"]) == 0
    assert "1 files, 1 s estimated" in capsys.readouterr().out
    _write(root, "test_unregistered.py", "def test_x():\n    pass\n")
    assert run_suite.main(["--suite", "e2e-cpu", "--root", str(root)]) == 2
    assert "test_unregistered.py: no SUITE" in capsys.readouterr().err
