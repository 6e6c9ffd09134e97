"""Start-up mistakes through the real CLI (`python -m sglite.launch_server`): each is found before any
weight loads and ends within 5 s in at most 3 lines, with no traceback, a non-zero exit and the flag
to change named; `--log-level debug` still shows the traceback."""

import glob
import os
import socket
import subprocess
import sys
import time

import pytest

SUITE = "unit-cpu"
EST_TIME = 12

LIMIT_S = 5.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config.json of a 64-position model; no weights (the checks must fail before any would load)."""
    from sglite.testing.tiny_models import tiny_config

    d = tmp_path_factory.mktemp("cfg_only")
    tiny_config("qwen3", max_position_embeddings=64).to_json_file(str(d / "config.json"))
    return str(d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*flags: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "sglite.launch_server", *flags], capture_output=True, text=True, timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return r, time.monotonic() - start


def _assert_one_clear_error(r: subprocess.CompletedProcess, elapsed: float, flag: str, *needles: str) -> None:
    out = (r.stdout + r.stderr).strip()
    assert r.returncode != 0, out
    assert len(out.splitlines()) <= 3, out
    assert "Traceback" not in out and flag in out, out
    for n in needles:
        assert n in out, out
    assert elapsed < LIMIT_S, f"{elapsed:.1f} s: {out}"


@pytest.mark.parametrize(
    "case, flags, flag, needles",
    [
        ("missing model", ["--model-path", "/nonexistent/model"], "--model-path", ["does not exist", "local"]),
        ("hub id, no network", ["--model-path", "Qwen/Qwen3-8B"], "--model-path", ["never downloads"]),
        ("model is a file", ["--model-path", "/etc/hostname"], "--model-path", ["not a directory"]),
        ("missing draft", ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/nonexistent/draft"],
         "--speculative-draft-model-path", ["does not exist"]),
        ("context over the model's", ["--context-length", "65"], "--context-length", ["64"]),
        ("context zero", ["--context-length", "0"], "--context-length", []),
        ("more ranks than cores", ["--tp-size", str(len(os.sched_getaffinity(0)) + 1)], "--tp-size", ["CPU cores"]),
    ],
)
def test_start_up_mistake_is_one_clear_line(model_dir, case, flags, flag, needles):
    if case == "more ranks than cores" and glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("a CUDA host counts devices, not cores")
    if "--model-path" not in flags:
        flags = ["--model-path", model_dir, *flags]
    r, elapsed = _launch(*flags, "--port", str(_free_port()))
    _assert_one_clear_error(r, elapsed, flag, *needles)


@pytest.mark.parametrize("architectures,model_type", [(["FooForCausalLM"], "qwen3"), ([], "foo")])
def test_unserved_architecture_is_one_line_naming_the_served_ones(tmp_path, architectures, model_type):
    """Refused before any process spawns, in one line that lists what is served (a config without
    ``architectures`` is resolved from its ``model_type``, as transformers does)."""
    import json

    from sglite.testing.tiny_models import tiny_config

    cfg = {**tiny_config("qwen3").to_dict(), "architectures": architectures, "model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r, elapsed = _launch("--model-path", str(tmp_path), "--port", str(_free_port()))
    _assert_one_clear_error(r, elapsed, "--model-path", "is not served by sglite", "DeepseekV3ForCausalLM",
                            "Qwen3MoeForCausalLM")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_a_broken_safetensors_checkpoint_is_one_line_naming_the_file(tmp_path, damage):
    from sglite.testing.tiny_models import build_tiny_model

    d = build_tiny_model(str(tmp_path / "m"), "qwen3", num_hidden_layers=1)
    weights = os.path.join(d, "model.safetensors")
    if damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif damage == "garbage":
        with open(weights, "wb") as f:
            f.write(b"\xff" * 64)
    else:
        os.remove(weights)
    r, elapsed = _launch("--model-path", d, "--port", str(_free_port()))
    _assert_one_clear_error(r, elapsed, "--model-path", "safetensors")


@pytest.mark.parametrize("damage", ["truncated", "impossible tensor count", "not utf-8"])
def test_a_broken_gguf_is_one_line_naming_the_defect(tmp_path, damage):
    import struct

    from sglite.testing.tiny_gguf import write_gguf
    from sglite.testing.tiny_models import build_tiny_model

    d = build_tiny_model(str(tmp_path / "m"), "qwen3", num_hidden_layers=1)
    path = write_gguf(d, str(tmp_path / "m.gguf"))
    with open(path, "r+b") as f:
        if damage == "truncated":
            f.truncate(os.path.getsize(path) - 1000)
        elif damage == "impossible tensor count":
            f.seek(8)
            f.write(struct.pack("<Q", 10**12))
        else:  # the first metadata key's bytes
            f.seek(4 + 4 + 8 + 8 + 8)
            f.write(b"\xff\xfe")
    r, elapsed = _launch("--model-path", path, "--port", str(_free_port()))
    _assert_one_clear_error(r, elapsed, "--model-path", "m.gguf")
    out = r.stderr
    assert {"truncated": "truncated", "impossible tensor count": "claims", "not utf-8": "not UTF-8"}[damage] in out, out


def test_a_folder_without_a_tokenizer_is_refused(model_dir):
    r, elapsed = _launch("--model-path", model_dir, "--port", str(_free_port()))
    _assert_one_clear_error(r, elapsed, "--model-path", "has no tokenizer", "--tokenizer-path")


def test_busy_port_is_found_before_the_model_loads(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        r, elapsed = _launch("--model-path", model_dir, "--port", port)
        _assert_one_clear_error(r, elapsed, "--port", "already in use")
        # --log-level debug keeps the traceback for whoever needs it.
        r, _ = _launch("--model-path", model_dir, "--port", port, "--log-level", "debug")
        assert r.returncode != 0 and "Traceback" in r.stderr and "--port" in r.stderr.splitlines()[-1]


def test_busy_bootstrap_port_of_a_prefill_node(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        r, elapsed = _launch("--model-path", model_dir, "--port", str(_free_port()), "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", str(busy.getsockname()[1]))
    _assert_one_clear_error(r, elapsed, "--disaggregation-bootstrap-port", "already in use")


def test_unreadable_model_dir(tmp_path, model_dir):
    if os.geteuid() == 0:
        pytest.skip("root reads every directory")
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0)
    try:
        r, elapsed = _launch("--model-path", str(d), "--port", str(_free_port()))
    finally:
        d.chmod(0o755)
    _assert_one_clear_error(r, elapsed, "--model-path", "not readable")
