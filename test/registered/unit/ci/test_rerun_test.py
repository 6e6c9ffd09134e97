"""scripts/ci/rerun_test.py: /rerun-test comments into (file, selector, runner) runs, with clear rejections."""

import json
import os

import pytest

from sglite.testing.scripts import load_script

SUITE = "unit-cpu"
EST_TIME = 3

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
rerun_test = load_script(os.path.join(REPO, "scripts", "ci", "rerun_test.py"))

REG = {
    "test/registered/unit/test_server_args.py": "unit-cpu",
    "test/registered/unit/mem_cache/test_memory_pool.py": "unit-cpu",
    "test/registered/e2e/test_openai_server.py": "e2e-cpu",
    "test/registered/unit/layers/attention/test_attention_gpu.py": "gpu",
}


def _one(comment):
    (run,) = rerun_test.parse_comment(comment, REG)
    return run.file, run.selector, run.runner


def test_file_only_defaults_to_the_suites_runner():
    assert _one("/rerun-test test/registered/unit/test_server_args.py") == (
        "test/registered/unit/test_server_args.py", "", "ubuntu-latest")
    assert _one("/rerun-test test/registered/unit/layers/attention/test_attention_gpu.py") == (
        "test/registered/unit/layers/attention/test_attention_gpu.py", "", "1-gpu-h100")


def test_short_paths_class_and_test_selectors():
    assert _one("/rerun-test unit/test_server_args.py::TestCli") == (
        "test/registered/unit/test_server_args.py", "TestCli", "ubuntu-latest")
    assert _one("/rerun-test registered/unit/test_server_args.py::TestCli::test_help 2-gpu") == (
        "test/registered/unit/test_server_args.py", "TestCli::test_help", "2-gpu")
    assert _one("/rerun-test unit/test_server_args.py::test_bad_flag_exits_with_one_line[pp_unsupported]")[1] == (
        "test_bad_flag_exits_with_one_line[pp_unsupported]")


def test_runner_label_and_runs_on():
    (run,) = rerun_test.parse_comment("/rerun-test unit/layers/attention/test_attention_gpu.py 2-gpu", REG)
    entry = run.matrix_entry()
    assert entry["runs_on"] == ["self-hosted", "2-gpu"] and entry["gpu"] is True
    assert entry["target"] == "test/registered/unit/layers/attention/test_attention_gpu.py"


def test_several_commands_in_one_comment_with_prose_around():
    comment = (
        "Flaky again, please:\n"
        "/rerun-test unit/test_server_args.py\n"
        "  /rerun-test e2e/test_openai_server.py::test_stream 1-gpu-h100  \n"
        "/rerun-test unit/test_server_args.py\n"
        "thanks"
    )
    runs = rerun_test.parse_comment(comment, REG)
    assert [(r.file, r.selector, r.runner) for r in runs] == [
        ("test/registered/unit/test_server_args.py", "", "ubuntu-latest"),
        ("test/registered/e2e/test_openai_server.py", "test_stream", "1-gpu-h100"),
    ]


@pytest.mark.parametrize(
    "comment,message",
    [
        ("/rerun-test test/registered/unit/test_nope.py", "not a registered test file"),
        ("/rerun-test test_server_args.py", "did you mean test/registered/unit/test_server_args.py"),
        ("/rerun-test test/run_suite.py", "not a registered test file"),
        ("/rerun-test test/conftest.py", "not a registered test file"),
        ("/rerun-test unit/test_server_args.py macos-latest", "unknown runner 'macos-latest'"),
        ("/rerun-test unit/test_server_args.py 8-gpu-b200", "unknown runner"),
        ("/rerun-test unit/layers/attention/test_attention_gpu.py ubuntu-latest", "gpu suite"),
        ("/rerun-test ../../etc/passwd.py", "not a test file path"),
        ("/rerun-test /abs/test_x.py", "not a test file path"),
        ("/rerun-test unit/test_server_args.py;id", "not a test file path"),
        ("/rerun-test unit/test_server_args.py;rm -rf /", "usage"),
        ("/rerun-test unit/test_server_args.py::test_x$(id)", "not a test class or function name"),
        ("/rerun-test unit/test_server_args.py::A::b::c", "at most"),
        ("/rerun-test", "usage"),
        ("/rerun-test unit/test_server_args.py 1-gpu-h100 extra", "usage"),
        ("please rerun the tests", "no /rerun-test command"),
        ("\n".join(["/rerun-test unit/test_server_args.py"] * 9), "at most 8"),
    ],
)
def test_rejections_say_why(comment, message):
    with pytest.raises(rerun_test.RerunRequestError, match=__import__("re").escape(message)):
        rerun_test.parse_comment(comment, REG)


def test_every_bad_line_is_reported():
    with pytest.raises(rerun_test.RerunRequestError) as err:
        rerun_test.parse_comment("/rerun-test unit/test_a.py\n/rerun-test unit/test_server_args.py gpu-x", REG)
    assert "test_a.py" in str(err.value) and "gpu-x" in str(err.value)


def test_real_registry_and_cli_github_output(tmp_path, monkeypatch, capsys):
    registered = rerun_test.registered_files()
    assert registered["test/registered/unit/ci/test_rerun_test.py"] == "unit-cpu"
    out = tmp_path / "github_output"
    monkeypatch.setenv("COMMENT", "/rerun-test unit/ci/test_rerun_test.py::test_real_registry_and_cli_github_output")
    assert rerun_test.main(["--comment-env", "COMMENT", "--github-output", str(out)]) == 0
    text = out.read_text()
    matrix_line = next(line for line in text.splitlines() if line.startswith("matrix="))
    matrix = json.loads(matrix_line.removeprefix("matrix="))
    assert matrix["include"][0]["target"] == (
        "test/registered/unit/ci/test_rerun_test.py::test_real_registry_and_cli_github_output")
    assert "summary=- `test/registered/unit/ci/test_rerun_test.py::" in text
    out.write_text("")
    assert rerun_test.main(["--comment", "/rerun-test nowhere/test_x.py", "--github-output", str(out)]) == 1
    assert out.read_text().startswith("error=") and "not a registered test file" in capsys.readouterr().err
