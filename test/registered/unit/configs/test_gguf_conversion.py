"""The GGUF metadata folder (configs.gguf) is byte for byte what transformers' own GGUF conversion writes
(AutoConfig / AutoTokenizer ``from_pretrained(folder, gguf_file=...)``), for tiny llama / qwen2 / qwen3 files
and for the default model, whose tokenizer then gives the same ids, chat template and decoded text."""

import filecmp
import json
import os
import shutil

import pytest
from transformers import AutoConfig, AutoTokenizer

from sglite.srt.configs import gguf
from sglite.srt.configs.gguf_header import read_gguf_header
from sglite.srt.default_model import default_model_path
from sglite.srt.managers.detokenizer_manager import load_tokenizer
from sglite.testing.tiny_gguf import write_gguf
from sglite.testing.tiny_models import build_tiny_model

SUITE = "unit-cpu"
EST_TIME = 60

# ARCH_OVERRIDES of test_gguf_weights: transformers' qwen3 mapping builds head_dim 128 from the GGUF.
ARCH_OVERRIDES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))


def _transformers_folder(gguf_file: str, out: str) -> str:
    """The metadata folder as transformers' GGUF loading builds it (the reference)."""
    folder, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    facts = gguf._file_facts(read_gguf_header(gguf_file))
    os.makedirs(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(gguf._served_config(config, facts), f, indent=2, sort_keys=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def _assert_same_folder(ours: str, ref: str) -> None:
    names = sorted(os.listdir(ref))
    assert sorted(os.listdir(ours)) == names
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    for n in names:
        assert filecmp.cmp(os.path.join(ours, n), os.path.join(ref, n), shallow=False), n


def _tiny_gguf(tmp_path, arch: str) -> str:
    hf = str(tmp_path / f"{arch}_hf")
    build_tiny_model(hf, arch, seed=5, num_hidden_layers=2, **ARCH_OVERRIDES[arch])
    os.makedirs(tmp_path / arch)
    return write_gguf(hf, str(tmp_path / arch / "model.gguf"), "Q8_0", tokenizer=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_folder_equals_transformers_conversion(tmp_path, arch):
    f = _tiny_gguf(tmp_path, arch)
    _assert_same_folder(gguf.gguf_metadata_dir(f), _transformers_folder(f, str(tmp_path / "ref")))


def test_tokenizer_files_beside_the_gguf_go_through_transformers(tmp_path):
    """A tokenizer_config.json next to the GGUF takes part in transformers' class choice, so that case is left
    to AutoTokenizer itself; the folder equals its conversion either way."""
    f = _tiny_gguf(tmp_path, "qwen2")
    with open(os.path.join(os.path.dirname(f), "tokenizer_config.json"), "w") as out:
        json.dump({"tokenizer_class": "TokenizersBackend"}, out)
    _assert_same_folder(gguf.gguf_metadata_dir(f), _transformers_folder(f, str(tmp_path / "ref")))


def test_default_model_folder_and_tokenizer_equal_transformers(tmp_path):
    path = default_model_path()
    ref = _transformers_folder(path, str(tmp_path / "ref"))
    ours = gguf.gguf_metadata_dir(path)
    _assert_same_folder(ours, ref)
    config = json.load(open(os.path.join(ours, "config.json")))
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"

    tok = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is the capital of France? <|im_end|> naïve café 東京 🙂\n\tcode: x = [1, 2]"},
    ]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    texts = [
        chat,
        "<|endoftext|><|im_start|>user\nhi<|im_end|>",
        "  leading spaces, trailing  ",
        "def f(x):\n    return x ** 2  # squares\n",
        "",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == theirs.encode(text), text
        assert tok.decode(ids) == theirs.decode(ids) == text
    ids = tok.encode(texts[1])
    assert ids[:2] == [0, 1] and ids[-1] == 2  # <|endoftext|>, <|im_start|> ... <|im_end|> stay single tokens
    assert (tok.bos_token_id, tok.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)


def test_cached_folder_is_reused(tmp_path):
    f = _tiny_gguf(tmp_path, "llama")
    first = gguf.gguf_metadata_dir(f)
    stamp = os.stat(os.path.join(first, "config.json")).st_mtime_ns
    assert gguf.gguf_metadata_dir(f) == first
    assert os.stat(os.path.join(first, "config.json")).st_mtime_ns == stamp
    shutil.rmtree(first)
    assert os.path.isfile(os.path.join(gguf.gguf_metadata_dir(f), "tokenizer.json"))  # rebuilt when missing
