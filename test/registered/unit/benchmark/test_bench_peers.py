"""bench_peers' batch-1 bandwidth report: the bytes a decode step reads, the box's bandwidth, the shares."""

import glob
import os

import pytest
from safetensors import safe_open

from sglite.testing.tiny_dflash import build_tiny_target

SUITE = "unit-cpu"
EST_TIME = 10

SCRIPT = "bench_peers"


def test_decode_step_bytes_are_the_layer_matrices_and_one_head(bench, tmp_path):
    model_dir = build_tiny_target(str(tmp_path / "target"), seed=1)
    matrices, vocab_rows = 0, None
    for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if name == "model.embed_tokens.weight":
                    vocab_rows = t.numel()  # the head reads all of it (tied or not); the lookup one row
                elif t.dim() == 2 and name != "lm_head.weight":
                    matrices += t.numel()
    assert vocab_rows is not None
    assert bench.decode_step_weight_bytes(model_dir) == 4 * (matrices + vocab_rows)


def test_batch1_share_of_the_measured_bandwidth(bench, capsys):
    measured = bench.measure_bandwidth(threads=1, mib=4, repeats=2)
    assert measured["read"] > 0 and measured["copy"] > 0
    table = [{"batch_size": 1, "sglite_decode_tok_s": 10.0}, {"batch_size": 8, "sglite_decode_tok_s": 50.0}]
    rounds = [{"read": 12.0, "copy": 10.0}, {"read": 13.0, "copy": 11.0}]
    out = bench.print_batch1_bandwidth(table, ["sglite"], step_bytes=10**9, bandwidth=rounds)
    assert out["sglite"] == pytest.approx(10.0) and out["read_gb_s"] == pytest.approx(12.5)
    assert "80% of read" in capsys.readouterr().out  # 10 GB/s of a 12.5 GB/s median
    assert bench.print_batch1_bandwidth(table[1:], ["sglite"], 10**9, rounds) == {}  # no batch-1 row


def test_sglite_gguf_is_counted_at_the_bytes_of_its_blocks(bench, tmp_path, capsys):
    from sglite.testing.tiny_gguf import write_gguf
    from sglite.testing.tiny_models import build_tiny_model

    hf_dir = build_tiny_model(str(tmp_path / "hf"), "llama", seed=1, num_hidden_layers=2)
    gguf = write_gguf(hf_dir, str(tmp_path / "model.gguf"), "Q8_0")
    blocks = bench.gguf_step_bytes(gguf)
    assert 0 < blocks < bench.decode_step_weight_bytes(hf_dir) / 3  # 34 bytes a 32-weight block against 128
    table = [{"batch_size": 1, "sglite-gguf_decode_tok_s": 10.0, "vllm_decode_tok_s": 10.0}]
    out = bench.print_batch1_bandwidth(table, ["sglite-gguf", "vllm"], 10**9, [{"read": 10.0, "copy": 10.0}], blocks)
    assert out["vllm"] == pytest.approx(10.0) and out["sglite-gguf"] == pytest.approx(blocks * 10.0 / 1e9)
    assert "reads the file's blocks instead" in capsys.readouterr().out
    assert bench.server_cmd("sglite-gguf", hf_dir, gguf, 1234, 1)[4] == gguf  # it serves the file itself


def test_peer_venvs_come_from_flags_and_a_missing_one_is_named(bench, tmp_path):
    venv = tmp_path / "vllm_venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    before = (bench.PEERS_VENV, bench.LLAMA_VENV)
    try:
        bench.set_peer_venvs(str(venv), str(tmp_path / "llama_venv"))
        assert bench.engine_python("vllm") == str(venv / "bin" / "python")
        assert bench.engine_python("ct2") == str(venv / "bin" / "python")
        assert bench.engine_python("llamacpp") == str(tmp_path / "llama_venv" / "bin" / "python")
        # A missing venv stops the run before any model is built, naming the flag that sets it.
        work = tmp_path / "work"
        with pytest.raises(SystemExit, match="--llama-venv"):
            bench.main(["--model", "smollm2", "--engines", "llamacpp", "--llama-venv", str(tmp_path / "none"),
                        "--work-dir", str(work)])
        assert not work.exists()
    finally:
        bench.set_peer_venvs(*before)
