"""benchmark/bench_attention.py: the CPU smoke run writes JSON with a correct kernel output and says it is not meaningful."""

SUITE = "unit-cpu"
EST_TIME = 5

import json
import os

import pytest
import torch

from sglite.testing.scripts import load_script

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "..", "benchmark", "bench_attention.py")


def _load_bench():
    return load_script(os.path.abspath(_BENCH))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path; CUDA runs it in scripts/gpu_check.sh")
@pytest.mark.parametrize("block_size", [1, 4])
def test_cpu_smoke_run_writes_json(tmp_path, capsys, block_size):
    bench = _load_bench()
    out = tmp_path / "attn.json"
    assert bench.main(["--cases", "2x40", "--page-size", "1", "--block-size", str(block_size), "--out", str(out)]) == 0
    assert "NOT meaningful" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["meaningful"] is False
    (r,) = data["results"]
    assert r["case"]["batch_size"] == 2 and r["case"]["seq_len"] == 40 and r["case"]["block_size"] == block_size
    assert r["kv_bytes"] == 2 * 40 * 1 * 2 * 64 * 4  # bs * ctx * kv_heads * (K+V) * head_dim * fp32
    assert r["max_abs_err"] < 1e-4  # the kernel's output matched dense attention


def test_parse_cases_rejects_garbage():
    bench = _load_bench()
    assert bench.parse_cases("1x32768, 32x8192") == [(1, 32768), (32, 8192)]
    with pytest.raises(Exception, match="BATCHxCONTEXT"):
        bench.parse_cases("32-8192")
