"""Where the GGUF metadata cache lives: SGLITE_CACHE_DIR, else $XDG_CACHE_HOME/sglite, else ~/.cache/sglite."""

import os

from sglite.srt.configs import gguf

SUITE = "unit-cpu"
EST_TIME = 2


def test_sglite_cache_dir_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert gguf._cache_root() == os.path.join(str(tmp_path / "s"), "gguf")


def test_xdg_cache_home_next(monkeypatch, tmp_path):
    monkeypatch.delenv("SGLITE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert gguf._cache_root() == os.path.join(str(tmp_path / "x"), "sglite", "gguf")


def test_home_cache_last(monkeypatch, tmp_path):
    monkeypatch.delenv("SGLITE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf._cache_root() == os.path.join(str(tmp_path), ".cache", "sglite", "gguf")


def test_suite_runs_with_a_throwaway_cache():
    # test/conftest.py (or run_suite.py) points the cache away from the user's home for every test.
    assert os.environ.get("SGLITE_CACHE_DIR")
    assert not os.environ["SGLITE_CACHE_DIR"].startswith(os.path.expanduser("~/.cache"))
