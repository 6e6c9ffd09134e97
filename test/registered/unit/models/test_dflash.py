"""DFLASH draft model: the block forward equals `dflash.model.DFlashDraftModel` on the same tiny weights."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.model_loader.weight_utils import WeightLoadingError
from sglite.srt.models.dflash import DFlashDraftModel
from sglite.testing.tiny_dflash import (
    TinyDraftSpec,
    assert_block_equals_reference,
    build_tiny_dflash_draft,
    build_tiny_target,
    draft_block_forward,
    load_reference_pair,
    load_sglite_draft,
)

SUITE = "unit-cpu"
EST_TIME = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target_dir = build_tiny_target(str(d / "target"), seed=0)
    draft_dir = build_tiny_dflash_draft(str(d / "draft"), target_dir, seed=1, spec=TinyDraftSpec(block_size=4))
    return target_dir, draft_dir


def test_config_is_public_format(pair):
    _, draft_dir = pair
    raw = json.load(open(os.path.join(draft_dir, "config.json")))
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 2]}
    names = set(load_file(os.path.join(draft_dir, "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any(n.startswith("embed_tokens") or n.startswith("lm_head") for n in names)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_block_forward_matches_reference(pair, one_rank, backend):
    """Context KV via write_context_kv + one DRAFT_BLOCK forward == the package's draft on the same features."""
    target_dir, draft_dir = pair
    target, ref = load_reference_pair(target_dir, draft_dir)
    ours = load_sglite_draft(draft_dir, target)
    block = ours.block_size
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(n, 2 * 64, generator=g) for n in (7, 3)]
    anchors = [17, 250]
    out, _ = draft_block_forward(ours, feats, anchors, backend=backend)
    assert out.next_token_logits.shape == (len(feats) * block, 512)
    assert_block_equals_reference(out, ref, target, feats, anchors, logits_atol=1e-4)


def test_unknown_weight_is_an_error(pair, one_rank):
    _, draft_dir = pair
    model = DFlashDraftModel(ModelConfig.from_path(draft_dir), params_dtype=torch.float32)
    weights = dict(load_file(os.path.join(draft_dir, "model.safetensors")))
    weights["layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    with pytest.raises(WeightLoadingError, match="layers.0.mlp.extra.weight"):
        model.load_weights(weights.items())
    weights.pop("layers.0.mlp.extra.weight")
    # A copy of the target's embedding is dropped (the draft uses the target's); a reduced vocabulary is refused.
    weights["embed_tokens.weight"] = torch.zeros(512, 64)
    model.load_weights(weights.items())
    weights["embed_tokens.weight"] = torch.zeros(300, 64)
    with pytest.raises(WeightLoadingError, match="reduced-vocabulary"):
        model.load_weights(weights.items())
    weights.pop("embed_tokens.weight")
    weights.pop("fc.weight")
    with pytest.raises(WeightLoadingError, match="missing"):
        model.load_weights(weights.items())


def test_default_target_layer_rule(tmp_path):
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "num_target_layers": 36, "dflash_config": {"mask_token_id": 511},
    }
    cfg = ModelConfig.from_dict(raw)
    from dflash.model import build_target_layer_ids

    assert cfg.draft.target_layer_ids == build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert cfg.draft.block_size == 16


@torch.no_grad()
def test_optional_scales_match_reference(pair, one_rank, tmp_path):
    """input_embedding_scale, output_multiplier and final_logit_softcapping (dflash_config) as the package applies them."""
    import shutil

    from dflash.model import _output_head, _raw_input_embeddings

    target_dir, draft_dir = pair
    scaled = str(tmp_path / "scaled")
    shutil.copytree(draft_dir, scaled)
    cfg_path = os.path.join(scaled, "config.json")
    raw = json.load(open(cfg_path))
    raw["dflash_config"].update(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)
    json.dump(raw, open(cfg_path, "w"))
    target, ref = load_reference_pair(target_dir, scaled)
    ours = load_sglite_draft(scaled, target)
    f = torch.randn(5, 2 * 64, generator=torch.Generator().manual_seed(8))
    out, _ = draft_block_forward(ours, [f], [99])
    block = ours.block_size
    ids = torch.tensor([[99] + [ref.mask_token_id] * (block - 1)])
    ref_h = ref(position_ids=torch.arange(5 + block)[None], noise_embedding=_raw_input_embeddings(target, ids, 2.0), target_hidden=f[None])[0]
    torch.testing.assert_close(out.hidden_states, ref_h, atol=1e-4, rtol=0)
    ref_logits = ref.compute_logits(ref_h, _output_head(target))
    torch.testing.assert_close(out.next_token_logits, ref_logits, atol=1e-4, rtol=0)
    assert float(out.next_token_logits.abs().max()) <= 3.0  # soft-capped


@torch.no_grad()
def test_bf16_context_projection_moves_wide_writes_by_bf16_rounding_only(pair, one_rank):
    """project_context_in_bf16: writes of >= BF16_PROJECTION_MIN_ROWS rows (a deferred catch-up, a prompt) take the
    bf16 copies, within bf16 rounding of the fp32 route; narrower ones (a drafted step's accepted rows) keep it."""
    from sglite.srt.layers.cpu_bf16_projection import BF16_PROJECTION_MIN_ROWS
    from sglite.srt.mem_cache.memory_pool import MHATokenToKVPool

    target_dir, draft_dir = pair
    target, _ = load_reference_pair(target_dir, draft_dir)
    exact, rounded = load_sglite_draft(draft_dir, target), load_sglite_draft(draft_dir, target)
    copies = rounded.project_context_in_bf16()
    cfg = exact.config
    kv_weights = sum(layer.self_attn.qkv_proj.weight[layer.self_attn.qkv_proj.q_size:].numel() for layer in exact.layers)
    assert copies == 2 * (exact.fc.weight.numel() + kv_weights)  # bf16 bytes; the tiny draft has no biases
    g = torch.Generator().manual_seed(5)
    for rows in (BF16_PROJECTION_MIN_ROWS - 1, BF16_PROJECTION_MIN_ROWS, 40):
        feats = torch.randn(rows, 2 * 64, generator=g) * 4
        pools = [MHATokenToKVPool(64, 1, torch.float32, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim,
                                  cfg.num_hidden_layers, "cpu") for _ in range(2)]
        slots, positions = torch.arange(1, rows + 1), torch.arange(rows) + 3
        exact.write_context_kv(feats, positions, slots, pools[0])
        rounded.write_context_kv(feats, positions, slots, pools[1])
        for layer in range(cfg.num_hidden_layers):
            for get in ("get_key_buffer", "get_value_buffer"):
                want, got = getattr(pools[0], get)(layer)[slots], getattr(pools[1], get)(layer)[slots]
                if rows < BF16_PROJECTION_MIN_ROWS:
                    assert torch.equal(got, want)
                else:
                    rel = float((got - want).norm() / want.norm())
                    assert 0.0 < rel < 2e-2, (rows, layer, get, rel)


def test_bf16_context_projection_copies_fp32_cpu_weights_only(pair, one_rank):
    target_dir, draft_dir = pair
    target, _ = load_reference_pair(target_dir, draft_dir)
    draft = load_sglite_draft(draft_dir, target)
    # Only fc's weight: Module.to() would also cast the rotary tables get_rope shares between models.
    draft.fc.weight.data = draft.fc.weight.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match="copy fp32 CPU weights"):
        draft.project_context_in_bf16()
