"""DSPARK draft: public config format, Markov head semantics (zeroed = DFLASH; non-zero = hand-computed chain)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.models.dflash import DFlashDraftModel
from sglite.srt.models.dspark import DSparkDraftModel
from sglite.srt.models.registry import get_model_class
from sglite.testing.greedy_margin import MIN_GREEDY_MARGIN
from sglite.testing.tiny_dflash import (
    build_tiny_dflash_draft,
    build_tiny_dspark_draft,
    build_tiny_target,
    draft_block_forward,
    load_reference_pair,
    load_sglite_draft,
)

SUITE = "unit-cpu"
EST_TIME = 20

# The repo's copies of shared/model_configs (identical files), so a fresh clone anywhere finds them.
PUBLIC_DSPARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "model_configs",
                             "dspark-qwen3-8b-block7.json")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark")
    target_dir = build_tiny_target(str(d / "target"), seed=0)
    dflash_dir = build_tiny_dflash_draft(str(d / "dflash"), target_dir, seed=1)
    zero_dir = build_tiny_dspark_draft(str(d / "dspark0"), dflash_dir, markov_rank=8, markov_scale=0.0)
    markov_dir = build_tiny_dspark_draft(str(d / "dspark"), dflash_dir, markov_rank=8, markov_scale=2.0, seed=5)
    return target_dir, dflash_dir, zero_dir, markov_dir


def test_public_dspark_config_resolves_and_builds(one_rank):
    cfg = ModelConfig.from_path(PUBLIC_DSPARK)
    spec = cfg.draft
    assert (spec.algorithm, spec.block_size, spec.mask_token_id, spec.markov_rank) == ("DSPARK", 7, 151669, 256)
    assert spec.target_layer_ids == [1, 9, 17, 25, 33] and spec.enable_confidence_head
    assert get_model_class(cfg) is DSparkDraftModel
    with torch.device("meta"):
        model = DSparkDraftModel(cfg, params_dtype=torch.bfloat16)
    assert tuple(model.markov_w1.weight.shape) == (151936, 256) and tuple(model.markov_w2.weight.shape) == (151936, 256)
    assert tuple(model.fc.weight.shape) == (4096, 5 * 4096)
    assert tuple(model.confidence_head.weight.shape) == (1, 4096 + 256)  # confidence_head_with_markov


def test_tiny_dspark_config_is_top_level_format(drafts):
    _, _, zero_dir, _ = drafts
    cfg = ModelConfig.from_path(zero_dir)
    assert "dflash_config" not in cfg.hf_config
    assert cfg.draft.algorithm == "DSPARK" and cfg.draft.markov_rank == 8 and cfg.draft.block_size == 4


def _contexts():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(n, 2 * 64, generator=g) for n in (6, 9, 2)], [17, 250, 3]


@torch.no_grad()
def test_zeroed_markov_head_drafts_like_dflash(drafts, one_rank):
    target_dir, dflash_dir, zero_dir, _ = drafts
    target, _ = load_reference_pair(target_dir, dflash_dir)
    dflash = load_sglite_draft(dflash_dir, target)
    dspark = load_sglite_draft(zero_dir, target)
    assert type(dflash) is DFlashDraftModel and type(dspark) is DSparkDraftModel
    ctx, anchors = _contexts()
    out_a, fb_a = draft_block_forward(dflash, ctx, anchors)
    out_b, fb_b = draft_block_forward(dspark, ctx, anchors)
    drafts_a = dflash.propose_drafts(out_a, fb_a, dflash.block_size)
    drafts_b = dspark.propose_drafts(out_b, fb_b, dspark.block_size)
    assert torch.equal(drafts_a, drafts_b)


@torch.no_grad()
def test_markov_head_drafts_the_hand_computed_chain(drafts, one_rank):
    target_dir, dflash_dir, _, markov_dir = drafts
    target, ref = load_reference_pair(target_dir, dflash_dir)  # the same backbone weights, package classes
    dspark = load_sglite_draft(markov_dir, target)
    weights = load_file(os.path.join(markov_dir, "model.safetensors"))
    w1, w2 = weights["markov_w1.weight"], weights["markov_w2.weight"]
    ctx, anchors = _contexts()
    out, fb = draft_block_forward(dspark, ctx, anchors)
    ours = dspark.propose_drafts(out, fb, dspark.block_size)
    block = dspark.block_size
    embed = target.get_input_embeddings().weight
    changed = False
    for i, (feats, anchor) in enumerate(zip(ctx, anchors)):
        ids = torch.tensor([[anchor] + [ref.mask_token_id] * (block - 1)])
        n = feats.shape[0]
        h = ref(position_ids=torch.arange(n + block)[None], noise_embedding=torch.nn.functional.embedding(ids, embed), target_hidden=feats[None])[0]
        logits = target.lm_head(h)  # [B, V]
        expected, prev = [], anchor
        for j in range(1, block):
            bias = w2 @ w1[prev]  # previous-token bias over the vocabulary
            top2 = (logits[j] + bias).topk(2).values
            # Drafts are compared exactly: only sound on any CPU without a near-tie (see greedy_margin).
            assert float(top2[0] - top2[1]) >= MIN_GREEDY_MARGIN, f"context {i} position {j}: near-tie"
            prev = int(torch.argmax(logits[j] + bias))
            expected.append(prev)
        assert ours[i].tolist() == expected
        changed |= expected != logits[1:].argmax(-1).tolist()
    assert changed, "the Markov bias should change at least one draft in this case"


@torch.no_grad()
@pytest.mark.parametrize("with_markov", [False, True])
def test_confidence_head(drafts, one_rank, tmp_path, with_markov):
    target_dir, dflash_dir, _, _ = drafts
    d = build_tiny_dspark_draft(
        str(tmp_path / "conf"), dflash_dir, markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=with_markov
    )
    target, _ = load_reference_pair(target_dir, dflash_dir)
    model = load_sglite_draft(d, target)
    w = load_file(os.path.join(d, "model.safetensors"))
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    prev = torch.tensor([1, 2, 3, 4, 5])
    x = torch.cat([hidden, w["markov_w1.weight"][prev]], dim=-1) if with_markov else hidden
    expected = torch.sigmoid(x @ w["confidence_head.weight"][0])
    torch.testing.assert_close(model.confidence(hidden, prev), expected)
