"""DSPARK draft against the `speculators` reference (0.9.0, `speculators/models/dspark/model_definitions.py`).

Tiny drafts in the released layout (SGLang 0.5.23 names), one per Markov head type: our Markov bias,
our confidence logits and the whole greedily drafted block equal the reference heads' for the same
weights and inputs; loading refuses unknown tensors by name; the released config resolves.
"""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.model_loader.weight_utils import WeightLoadingError
from sglite.srt.models.dflash import DFlashDraftModel
from sglite.srt.models.dspark import DSparkDraftModel
from sglite.srt.models.registry import get_model_class
from sglite.testing.greedy_margin import MIN_GREEDY_MARGIN
from sglite.testing.speculators_reference import load_dspark_model_definitions
from sglite.testing.tiny_dflash import (
    build_tiny_dflash_draft,
    build_tiny_dspark_draft,
    build_tiny_target,
    draft_block_forward,
    load_reference_pair,
    load_sglite_draft,
)

SUITE = "unit-cpu"
EST_TIME = 12

RANK = 8
HEAD_TYPES = ("vanilla", "gated", "rnn")

# The repo's copies of shared/model_configs (identical files), so a fresh clone anywhere finds them.
PUBLIC_DSPARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "model_configs",
                             "dspark-qwen3-8b-block7.json")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark")
    target_dir = build_tiny_target(str(d / "target"), seed=0)
    dflash_dir = build_tiny_dflash_draft(str(d / "dflash"), target_dir, seed=1)
    target, _ = load_reference_pair(target_dir, dflash_dir)
    return d, target_dir, dflash_dir, target


def _dspark(base, name, **kw):
    d, target_dir, dflash_dir, _ = base
    return build_tiny_dspark_draft(
        str(d / name), dflash_dir, markov_rank=RANK, markov_scale=2.0, seed=5, enable_confidence_head=True,
        confidence_head_with_markov=True, with_embeddings=True, target_dir=target_dir, **kw,
    )


def _reference_heads(draft_dir):
    """speculators' MarkovHead / ConfidenceHead holding this checkpoint's tensors."""
    ref = load_dspark_model_definitions()
    cfg = ModelConfig.from_path(draft_dir)
    w = load_file(os.path.join(draft_dir, "model.safetensors"))
    markov = ref.MarkovHead(
        verifier_vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size, markov_rank=RANK,
        hidden_size=cfg.hidden_size, head_type=cfg.draft.markov_head_type,
    )
    markov.load_state_dict({k[len("markov_head."):]: v for k, v in w.items() if k.startswith("markov_head.")})
    width = cfg.hidden_size + (RANK if cfg.draft.confidence_head_with_markov else 0)
    conf = ref.ConfidenceHead(width)
    conf.load_state_dict({k[len("confidence_head."):]: v for k, v in w.items() if k.startswith("confidence_head.")})
    return markov.eval(), conf.eval()


def _contexts():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(n, 2 * 64, generator=g) for n in (6, 9, 2)], [17, 250, 3]


def test_public_dspark_config_resolves_and_builds(one_rank):
    cfg = ModelConfig.from_path(PUBLIC_DSPARK)
    spec = cfg.draft
    assert (spec.algorithm, spec.block_size, spec.mask_token_id, spec.markov_rank) == ("DSPARK", 7, 151669, 256)
    assert spec.target_layer_ids == [1, 9, 17, 25, 33] and spec.enable_confidence_head
    # speculators' DSpark default: slot k predicts p+k+1, so a block of 7 proposes 7 drafts.
    assert spec.sample_from_anchor and spec.num_proposed_drafts == 7 and spec.confidence_head_with_markov
    assert get_model_class(cfg) is DSparkDraftModel
    with torch.device("meta"):
        model = DSparkDraftModel(cfg, params_dtype=torch.bfloat16)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["markov_head.markov_w1.weight"] == (151936, 256)
    assert shapes["markov_head.markov_w2.weight"] == (151936, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 4096 + 256) and shapes["confidence_head.proj.bias"] == (1,)
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in shapes)  # the target's are used


@torch.no_grad()
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_bias_and_confidence_equal_the_reference(base, one_rank, head_type):
    draft_dir = _dspark(base, f"heads_{head_type}", markov_head_type=head_type)
    model = load_sglite_draft(draft_dir, base[3])
    markov, conf = _reference_heads(draft_dir)
    g = torch.Generator().manual_seed(7)
    n, block, hidden_size = 3, model.block_size, model.config.hidden_size
    hidden = torch.randn(n, block, hidden_size, generator=g)
    prev = torch.randint(0, model.config.vocab_size, (n, block), generator=g)
    expected_bias = markov.block_bias(prev_token_ids=prev, hidden_states=hidden)
    expected_conf = conf(torch.cat([hidden, markov.prev_embeddings(prev)], dim=-1))
    head = model.markov_head
    state = head.initial_state(n, hidden)
    for k in range(block):  # ours runs one slot at a time (drafting feeds each slot's output to the next)
        emb = head.embed_prev(prev[:, k])
        bias, state = head.step(emb, hidden[:, k], state)
        torch.testing.assert_close(bias, expected_bias[:, k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.confidence_logits(hidden[:, k], emb), expected_conf[:, k])
    assert float(expected_bias.abs().max()) > 1.0  # a bias large enough to matter
    # A token map keeps markov_w2's rows of its ids: the bias is exactly those columns of the full one.
    ids = torch.randperm(model.config.vocab_size, generator=g)[: model.config.vocab_size // 3]
    head.restrict_output(ids)
    assert head.markov_w2.weight.shape == (len(ids), RANK)
    state = head.initial_state(n, hidden)
    for k in range(block):
        bias, state = head.step(head.embed_prev(prev[:, k]), hidden[:, k], state)
        torch.testing.assert_close(bias, expected_bias[:, k][:, ids], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("head_type, sample_from_anchor", [(t, True) for t in HEAD_TYPES] + [("rnn", False)])
def test_drafted_block_equals_the_reference(base, one_rank, head_type, sample_from_anchor):
    """Greedy, left to right: slot k's bias uses the token at p+k (sample_from_anchor) or p+k-1."""
    target = base[3]
    draft_dir = _dspark(base, f"block_{head_type}_{sample_from_anchor}", markov_head_type=head_type,
                        sample_from_anchor=sample_from_anchor)
    model = load_sglite_draft(draft_dir, target)
    markov, conf = _reference_heads(draft_dir)
    ctx, anchors = _contexts()
    out, fb = draft_block_forward(model, ctx, anchors)
    proposal = model.propose_drafts(out, fb, model.block_size)
    block = model.block_size
    hidden = out.hidden_states.reshape(len(anchors), block, -1)
    logits = target.lm_head(hidden)  # the target's head (transformers), as the reference drafts with it
    first = 0 if sample_from_anchor else 1
    assert proposal.ids.shape == (len(anchors), block - first)
    changed = False
    for i, anchor in enumerate(anchors):
        # The block's tokens t[0] = anchor, t[j] = the token at p+j once drafted (later slots cannot
        # affect slot k: the reference heads are causal over slots). prev_token_ids as speculators
        # builds them: slot k's previous token is t[k] (anchor convention) or t[k-1] (DFlash, slot 0 = t[0]).
        t = [anchor] * (block + 1)
        expected, expected_conf = [], []
        for k in range(first, block):
            row = torch.tensor([t[:block]])
            prev_ids = row if sample_from_anchor else torch.cat([row[:, :1], row[:, :-1]], dim=1)
            bias = markov.block_bias(prev_token_ids=prev_ids, hidden_states=hidden[i : i + 1])[0, k]
            scores = logits[i, k] + bias
            top2 = scores.topk(2).values
            assert float(top2[0] - top2[1]) >= MIN_GREEDY_MARGIN, f"context {i} slot {k}: near-tie"
            pick = int(scores.argmax())
            emb = markov.prev_embeddings(prev_ids)[0, k]
            expected_conf.append(float(conf(torch.cat([hidden[i, k], emb]))))
            expected.append(pick)
            t[k + 1 if sample_from_anchor else k] = pick
        assert proposal.ids[i].tolist() == expected
        torch.testing.assert_close(proposal.confidence_logits[i], torch.tensor(expected_conf), rtol=1e-5, atol=1e-5)
        changed |= expected != logits[i, first:].argmax(-1).tolist()
    assert changed, "the Markov bias should change at least one draft"


@torch.no_grad()
def test_zeroed_markov_head_in_dflash_convention_drafts_like_dflash(base, one_rank):
    d, target_dir, dflash_dir, target = base
    zero_dir = build_tiny_dspark_draft(str(d / "zero"), dflash_dir, markov_rank=RANK, markov_scale=0.0,
                                       sample_from_anchor=False)
    dflash, dspark = load_sglite_draft(dflash_dir, target), load_sglite_draft(zero_dir, target)
    assert type(dflash) is DFlashDraftModel and type(dspark) is DSparkDraftModel
    ctx, anchors = _contexts()
    out_a, fb_a = draft_block_forward(dflash, ctx, anchors)
    out_b, fb_b = draft_block_forward(dspark, ctx, anchors)
    assert torch.equal(dflash.propose_drafts(out_a, fb_a, 4).ids, dspark.propose_drafts(out_b, fb_b, 4).ids)


def test_unknown_and_reduced_vocab_tensors_are_named_errors(base, one_rank, tmp_path):
    target = base[3]
    good = _dspark(base, "load_errors", markov_head_type="gated")
    weights = load_file(os.path.join(good, "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(os.path.join(good, "config.json")) as f:
        (bad / "config.json").write_text(f.read())
    save_file(dict(weights, **{"markov_head.extra_proj.weight": torch.zeros(2, 2)}), str(bad / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match="markov_head.extra_proj.weight"):
        load_sglite_draft(str(bad), target)
    save_file(dict(weights, **{"lm_head.weight": torch.zeros(100, 64)}), str(bad / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match="reduced-vocabulary"):
        load_sglite_draft(str(bad), target)
    del weights["markov_head.gate_proj.bias"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match="gate_proj.bias"):
        load_sglite_draft(str(bad), target)
