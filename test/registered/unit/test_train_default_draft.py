"""The default draft's training script (scripts/train_default_draft.py): the distillation loss's Gram identity,
the alignment of the target's final hidden states with the block slots, the feature-scale fold into fc,
starting the draft's layers from the target's (--init-layers), and training steps under --autocast."""

from pathlib import Path

import pytest
import torch

from sglite.testing.scripts import load_script

SUITE = "unit-cpu"
EST_TIME = 30

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def script():
    return load_script(REPO / "scripts" / "train_default_draft.py")


def test_gram_gives_the_mean_squared_centred_logit_error(script):
    g = torch.Generator().manual_seed(0)
    head = torch.randn(500, 16, generator=g, dtype=torch.float64)
    h_draft, h_target = torch.randn(3, 16, generator=g, dtype=torch.float64), torch.randn(3, 16, generator=g, dtype=torch.float64)
    dz = (h_draft - h_target) @ head.T
    dz = dz - dz.mean(-1, keepdim=True)  # softmax ignores a common shift of the logits
    d = h_draft - h_target
    gram = script.centred_head_gram(head)
    torch.testing.assert_close(((d @ gram) * d).sum(-1), dz.pow(2).mean(-1))


def _data(script, H, lens, prompt_len):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(n, 4 * H + H, generator=g) for n in lens]
    # the final-hidden columns hold their own position, so the gathered values name the position they came from
    for f in rows:
        f[:, -H:] = torch.arange(f.shape[0], dtype=torch.float32)[:, None]
    tokens = [torch.randint(5, 100, (n,), generator=g) for n in lens]
    return script.DraftData(tokens=tokens, features=rows, prompt_lens=[prompt_len] * len(lens), valid_lens=list(lens))


def test_block_slot_j_gets_the_target_final_hidden_at_anchor_plus_j_minus_1(script):
    H, B = 4, 8
    cfg = script.DraftConfig(block_size=B, blocks_per_seq=3, draft_batch_size=2)
    data = _data(script, H, [30, 24], prompt_len=5)
    batch = script.sample_draft_batch(data, cfg, 0, torch.Generator().manual_seed(2))
    ctx, finals = script.block_targets(batch, B, H)
    T = ctx.shape[1]
    assert ctx.shape[-1] == 4 * H
    anchors = batch.position_ids[:, T::B]
    for n in range(2):
        for k in range(3):
            for j in range(1, B):
                if batch.labels[n, k, j - 1] >= 0:
                    assert finals[n, k, j - 1, 0].item() == anchors[n, k].item() + j - 1


def test_feature_scale_folds_into_fc(script):
    H = 4
    data = _data(script, H, [12, 9], prompt_len=2)
    scale = script.feature_rms_scale(data, 4 * H)
    scaled = script.scale_features(data, scale)
    fc = torch.nn.Linear(4 * H, H, bias=False)
    x_raw, x_scaled = data.features[0][:, : 4 * H], scaled.features[0][:, : 4 * H]
    torch.testing.assert_close(scaled.features[0][:, 4 * H :], data.features[0][:, 4 * H :])  # finals untouched
    expected = fc(x_scaled)
    with torch.no_grad():
        fc.weight.mul_(scale)
    torch.testing.assert_close(fc(x_raw), expected, rtol=1e-4, atol=1e-4)


def _tiny_llama(layers=4, intermediate=48):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_init_layers_copies_the_target_layers(script):
    target = _tiny_llama()
    cfg = script.DraftConfig(draft_layers=2, draft_intermediate_size=48, block_size=4, init_layers="2,3")
    draft = script.build_draft(cfg, target, mask_token_id=0, layer_ids=[1, 2])
    for layer, tid in zip(draft.layers, (2, 3)):
        source = dict(target.model.layers[tid].named_parameters())
        copied = [n for n, _ in layer.named_parameters() if n in source]
        assert len(copied) == len(source) == 9  # q/k/v/o, gate/up/down, two norms
        for name, param in layer.named_parameters():
            if name in source:
                assert torch.equal(param, source[name]), name
            else:  # Qwen3's per-head q/k norms have no Llama counterpart: they start at 1
                assert name.endswith(("q_norm.weight", "k_norm.weight")) and torch.equal(param, torch.ones_like(param))
    fresh = script.build_draft(script.DraftConfig(draft_layers=2, draft_intermediate_size=48, block_size=4, init_layers=""), target, 0, [1, 2])
    assert not torch.equal(fresh.layers[0].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)


def test_init_layers_refuses_a_mismatch(script):
    target = _tiny_llama()
    with pytest.raises(SystemExit, match="names 1 layers"):
        script.build_draft(script.DraftConfig(draft_layers=2, draft_intermediate_size=48, init_layers="3"), target, 0, [1, 2])
    with pytest.raises(SystemExit, match="the target has 4 layers"):
        script.build_draft(script.DraftConfig(draft_layers=2, draft_intermediate_size=48), target, 0, [1, 2])  # default 28,29
    with pytest.raises(SystemExit, match=r"mlp\.gate_proj\.weight is \(48, 32\) in the target, \(40, 32\)"):
        script.build_draft(script.DraftConfig(draft_layers=2, draft_intermediate_size=40, init_layers="2,3"), target, 0, [1, 2])


@pytest.mark.parametrize("autocast", ["float32", "bfloat16"])
def test_training_steps_under_either_autocast_keep_fp32_weights_and_learn(script, autocast):
    """--autocast bfloat16 runs the forward and the head in bf16 but keeps fp32 weights; on learnable rows the loss
    falls under either setting, and the bf16 first-step loss is the fp32 one within bf16 rounding."""
    target = _tiny_llama()
    for p in target.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    rows = 4
    data = script.DraftData(
        tokens=[(torch.arange(24) * 3 + 7 * r) % 64 for r in range(rows)],  # each next token follows from the anchor
        features=[torch.randn(24, 2 * 32, generator=gen).to(torch.bfloat16) for _ in range(rows)],
        prompt_lens=[4] * rows,
        valid_lens=[24] * rows,
    )
    losses = {}
    for mode in ("float32", autocast):
        torch.manual_seed(1)
        cfg = script.DraftConfig(draft_layers=1, draft_intermediate_size=48, block_size=4, init_layers="",
                                 draft_steps=30, draft_batch_size=2, blocks_per_seq=4, eval_chunk=-1, autocast=mode)
        draft = script.build_draft(cfg, target, mask_token_id=0, layer_ids=[1, 2])
        vocab = torch.arange(64)
        stats = script.train_draft(cfg, draft, target, data, vocab)
        assert stats["steps_done"] == 30 and all(p.dtype == torch.float32 for p in draft.parameters())
        losses[mode] = stats
    got = losses[autocast]
    assert torch.isfinite(torch.tensor(got["final_loss"]))
    assert got["first_loss"] == pytest.approx(losses["float32"]["first_loss"], rel=0.03)
    assert got["final_loss"] < got["first_loss"]


def test_bad_training_flags_are_refused_before_the_reply_stage(script, monkeypatch):
    """A typo in a training flag fails at once, before the target loads and the replies are generated."""
    monkeypatch.setattr(script, "load_target", lambda *a: pytest.fail("the target loaded before the flags were checked"))
    with pytest.raises(SystemExit, match="--autocast must be float32 or bfloat16, got 'fp16'"):
        script.main(["--autocast", "fp16"])
    with pytest.raises(SystemExit, match="--loss must be distill or ce"):
        script.main(["--loss", "mse"])


def test_token_map_keeps_the_most_frequent_reply_tokens(script, tmp_path):
    """Reply tokens only (prompts are not drafted), most frequent first, ties by id; coverage is reported."""
    tokens = [torch.tensor([9, 9, 9, 1, 1, 2, 2, 5]), torch.tensor([9, 3, 3, 4, 4, 4, 0])]
    data = script.DraftData(tokens=tokens, features=[None, None], prompt_lens=[3, 1], valid_lens=[8, 6])
    # reply tokens: [1, 1, 2, 2, 5] and [3, 3, 4, 4, 4]
    assert script.hot_token_ids(data, 3).tolist() == [4, 1, 2]
    cfg = script.DraftConfig(token_map_size=3)
    info = script.write_token_map(cfg, data, tmp_path)
    assert torch.load(tmp_path / script.TOKEN_MAP_FILE).tolist() == [4, 1, 2]
    assert info == {"size": 3, "training_reply_tokens_covered": 0.7}
    assert script.write_token_map(script.DraftConfig(token_map_size=0), data, tmp_path / "none") is None
