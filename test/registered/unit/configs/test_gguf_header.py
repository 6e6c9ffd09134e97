"""configs.gguf_header reads what the gguf package's GGUFReader reads (every metadata value, the tensor table,
the tensor bytes), on a tiny file with a tokenizer and on the default model's 49k-token GGUF; bad files fail clearly."""

import struct

import gguf
import numpy as np
import pytest

from sglite.srt.configs.gguf_header import GGUFFormatError, read_gguf_header
from sglite.srt.default_model import default_model_path
from sglite.testing.tiny_gguf import write_gguf
from sglite.testing.tiny_models import build_tiny_model

SUITE = "unit-cpu"
EST_TIME = 20


def _assert_same_as_gguf_reader(path: str, byte_checks: int) -> None:
    ours = read_gguf_header(path)
    ref = gguf.GGUFReader(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # GGUFReader's own header fields
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
        assert type(ours.metadata[key]) is type(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert mine.ggml_type == int(theirs.tensor_type)
        assert mine.data_offset == theirs.data_offset
    step = max(1, len(ref.tensors) // byte_checks)
    for mine, theirs in list(zip(ours.tensors, ref.tensors))[::step]:
        raw = ours.tensor_bytes(mine)
        assert not raw.flags.writeable  # a view of the read-only mapping, not a copy
        assert np.array_equal(raw.reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1)), mine.name


@pytest.mark.parametrize("quant", ["F32", "Q4_1"])
def test_tiny_file_reads_like_gguf_reader(tmp_path, quant):
    hf = str(tmp_path / "hf")
    build_tiny_model(hf, "llama", seed=5, num_hidden_layers=2)
    path = write_gguf(hf, str(tmp_path / "m.gguf"), quant, tokenizer=True)
    header = read_gguf_header(path)
    assert isinstance(header.metadata["tokenizer.ggml.tokens"], list)  # the string arrays are read in full
    assert header.tensors[0].shape == tuple(reversed(header.tensors[0].dims))
    _assert_same_as_gguf_reader(path, byte_checks=1000)


def test_default_model_reads_like_gguf_reader():
    path = default_model_path()
    header = read_gguf_header(path)
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(header.metadata["tokenizer.ggml.merges"]) == 48900
    _assert_same_as_gguf_reader(path, byte_checks=20)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf_header(str(bad))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf_header(str(empty))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + struct.pack("<I", 3))
    with pytest.raises(GGUFFormatError, match="truncated or corrupt GGUF header"):
        read_gguf_header(str(cut))


def test_unsupported_version_and_value_type(tmp_path):
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GGUFFormatError, match="GGUF version 1 is not supported"):
        read_gguf_header(str(v1))
    odd = tmp_path / "odd.gguf"
    key = b"general.architecture"
    odd.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 99))
    with pytest.raises(GGUFFormatError, match="unknown GGUF metadata value type 99"):
        read_gguf_header(str(odd))
