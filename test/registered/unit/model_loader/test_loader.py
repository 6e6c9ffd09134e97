"""safetensors loading: single file and sharded index, tied embeddings, and clear errors for bad checkpoints."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.model_loader.loader import load_model
from sglite.srt.model_loader.weight_utils import WeightLoadingError, safetensors_files
from sglite.testing.tiny_models import build_tiny_model

SUITE = "unit-cpu"
EST_TIME = 15


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("single")), "qwen3", seed=1, with_tokenizer=False)


def _load(path):
    return load_model(ModelConfig.from_path(path), path, torch.device("cpu"), torch.float32, show_progress=False)


def _hf_state(path):
    out = {}
    for f in safetensors_files(path):
        out.update(load_file(f))
    return out


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint to dst with its tensors edited by ``edit(dict)``."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_single_file_loads_every_tensor(single, one_rank):
    model = _load(single)
    ref = _hf_state(single)
    params = dict(model.named_parameters())
    torch.testing.assert_close(params["model.embed_tokens.weight"], ref["model.embed_tokens.weight"], rtol=0, atol=0)
    qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
    want = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv, want, rtol=0, atol=0)
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    torch.testing.assert_close(gate_up, torch.cat([ref["model.layers.0.mlp.gate_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"]]), rtol=0, atol=0)
    torch.testing.assert_close(params["model.layers.0.self_attn.q_norm.weight"], ref["model.layers.0.self_attn.q_norm.weight"], rtol=0, atol=0)


def test_sharded_index_equals_single_file(tmp_path, single, one_rank):
    sharded = build_tiny_model(str(tmp_path / "sharded"), "qwen3", seed=1, with_tokenizer=False, max_shard_size="60KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len(safetensors_files(sharded)) > 1
    a, b = dict(_load(single).named_parameters()), dict(_load(sharded).named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_tied_embeddings_without_lm_head_tensor(tmp_path, one_rank):
    d = build_tiny_model(str(tmp_path / "tied"), "llama", seed=2, with_tokenizer=False, tie_word_embeddings=True)
    assert "lm_head.weight" not in _hf_state(d)
    model = _load(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_tensor_is_named(tmp_path, single, one_rank):
    d = _rewrite(single, str(tmp_path / "missing"), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadingError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(d)
    d2 = _rewrite(single, str(tmp_path / "missing_k"), lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadingError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        _load(d2)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path, single, one_rank):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    d = _rewrite(single, str(tmp_path / "bad_shape"), edit)
    with pytest.raises(WeightLoadingError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        _load(d)

    def edit_norm(t):
        t["model.norm.weight"] = torch.ones(65)

    d = _rewrite(single, str(tmp_path / "bad_norm"), edit_norm)
    with pytest.raises(WeightLoadingError, match=r"model\.norm\.weight.*\(65,\)"):
        _load(d)


def test_unexpected_tensor_is_an_error(tmp_path, single, one_rank):
    def edit(t):
        t["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3)

    d = _rewrite(single, str(tmp_path / "extra"), edit)
    with pytest.raises(WeightLoadingError, match="does not use.*mystery"):
        _load(d)


def test_no_weights_and_broken_index(tmp_path, single, one_rank):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(os.path.join(single, "config.json"), empty)
    with pytest.raises(WeightLoadingError, match="no safetensors weights"):
        _load(str(empty))
    with open(empty / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(WeightLoadingError, match="do not exist"):
        _load(str(empty))


def test_unsupported_architecture(tmp_path, single, one_rank):
    d = tmp_path / "arch"
    shutil.copytree(single, d)
    cfg = json.load(open(d / "config.json"))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not served by sglite; served:"):
        _load(str(d))


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path, one_rank):
    """Some tied checkpoints store lm_head.weight anyway; it is skipped and the head stays tied."""
    src = build_tiny_model(str(tmp_path / "tied_src"), "qwen2", seed=4, with_tokenizer=False, tie_word_embeddings=True)

    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    d = _rewrite(src, str(tmp_path / "tied_with_head"), edit)
    model = _load(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, _hf_state(src)["model.embed_tokens.weight"], rtol=0, atol=0)
