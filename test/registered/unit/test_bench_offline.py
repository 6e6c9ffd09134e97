"""The benchmarks' shared helpers: random prompt ids and the model-directory check."""

import pytest

from sglite.bench_offline import random_prompt_ids, resolve_model_dir
from sglite.srt.default_model import default_model_path

SUITE = "unit-cpu"
EST_TIME = 2


def test_random_prompt_ids_shape_range_and_seed():
    a = random_prompt_ids(4, 16, 100, seed=3)
    assert len(a) == 4 and all(len(p) == 16 for p in a)
    assert all(8 <= t < 100 for p in a for t in p)
    assert a == random_prompt_ids(4, 16, 100, seed=3) != random_prompt_ids(4, 16, 100, seed=4)


def test_resolve_model_dir_defaults_and_exits_naming_the_flag(tmp_path, capsys):
    assert resolve_model_dir(None, "bench_x") == default_model_path()
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path), "bench_x") == str(tmp_path)
    with pytest.raises(SystemExit) as e:
        resolve_model_dir(str(tmp_path / "missing"), "bench_x")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "bench_x: no model at" in err and "--model-path" in err
