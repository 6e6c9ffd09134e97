"""ModelConfig on every real config.json (copies of shared/model_configs), plus 4.x / 5.x spelling variants.

Expected numbers are written out by hand from the config files and shared/model_configs/README.md
(weight-shape cross-checks), and where transformers knows the architecture, checked against its
own config class too — never taken from our parser's output.
"""

import copy
import json
import os
from collections import Counter

import pytest

from sglite.srt.configs.model_config import AttentionKind, ModelConfig, ModelConfigError, build_target_layer_ids

SUITE = "unit-cpu"
EST_TIME = 8

# Copies of shared/model_configs (provenance in its README.md), so a fresh clone tests them too.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
needs_configs = pytest.mark.skipif(not os.path.isdir(CONFIG_DIR), reason=f"real model configs not found at {CONFIG_DIR}")

F, S, M, L = AttentionKind.FULL, AttentionKind.SLIDING, AttentionKind.MLA, AttentionKind.LINEAR

# Per file: hand-written geometry. kinds = {kind: count}; full_ids = indices of full/MLA layers when hybrid.
EXPECTED = {
    "qwen3-8b.json": dict(layers=36, kv=8, hd=128, vhd=128, kinds={F: 36}, hidden=4096, vocab=151936, theta=1e6),
    "qwen3-14b.json": dict(layers=40, kv=8, hd=128, vhd=128, kinds={F: 40}, hidden=5120, vocab=151936, theta=1e6),
    # No head_dim key: 4096 / 32 heads = 128.
    "llama-3.1-8b-instruct.json": dict(
        layers=32, kv=8, hd=128, vhd=128, kinds={F: 32}, hidden=4096, vocab=128256, theta=500000.0,
        eos=[128001, 128008, 128009], rope_type="llama3",
    ),
    # MLA: kv_a 576 = kv_lora_rank 512 + rope 64; q head = nope 128 + rope 64; v 128.
    "deepseek-v3.json": dict(
        layers=61, kv=128, hd=192, vhd=128, kinds={M: 61}, mla=(512, 64), hidden=7168, vocab=129280, theta=10000.0,
        rope_type="yarn",
    ),
    "kimi-k2-instruct.json": dict(
        layers=61, kv=64, hd=192, vhd=128, kinds={M: 61}, mla=(512, 64), hidden=7168, vocab=163840, theta=50000.0,
    ),
    # 18 sliding (window 128) at even layers, 18 full at odd; head_dim 64 != 2880/64.
    "gpt-oss-120b.json": dict(
        layers=36, kv=8, hd=64, vhd=64, kinds={S: 18, F: 18}, window=128, full_ids=list(range(1, 36, 2)),
        hidden=2880, vocab=201088, theta=150000.0,
    ),
    # Full attention every 4th layer (3, 7, ..., 47); Gated DeltaNet elsewhere: 32 value heads of 128x128 state,
    # conv channels 2*16*128 + 32*128 = 8192 (README: conv1d channels 8192), kernel 4.
    "qwen3-next-80b-a3b-instruct.json": dict(
        layers=48, kv=2, hd=256, vhd=256, kinds={L: 36, F: 12}, full_ids=list(range(3, 48, 4)),
        linear=(32, 128, 128, 8192, 4), hidden=2048, vocab=151936, theta=1e7,
    ),
    # 1-based full_attn_layers [4, 8, ..., 24, 27] -> 0-based MLA layers; 20 KDA layers with q/k/v convs 3*32*128.
    "kimi-linear-48b-a3b-instruct.json": dict(
        layers=27, kv=32, hd=192, vhd=128, kinds={L: 20, M: 7}, full_ids=[3, 7, 11, 15, 19, 23, 26], mla=(512, 64),
        linear=(32, 128, 128, 12288, 4), hidden=2304, vocab=163840, max_pos=1048576,
    ),
    # Nested text_config; 10 global layers at 5, 11, ..., 59; 52 sliding with window 1024; ties lm_head.
    "gemma-3-27b-it.json": dict(
        layers=62, kv=16, hd=128, vhd=128, kinds={S: 52, F: 10}, window=1024, full_ids=list(range(5, 62, 6)),
        hidden=5376, vocab=262208, tie=True, eos=[1, 106],
    ),
    "qwen3-8b-dflash-b16.json": dict(
        layers=5, kv=8, hd=128, vhd=128, kinds={F: 5}, hidden=4096, vocab=151936,
        draft=dict(algorithm="DFLASH", block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                   num_target_layers=36, markov_rank=0),
    ),
    "dspark-qwen3-8b-block7.json": dict(
        layers=5, kv=8, hd=128, vhd=128, kinds={F: 5}, hidden=4096, vocab=151936, theta=1e6,
        draft=dict(algorithm="DSPARK", block_size=7, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                   num_target_layers=36, markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True),
    ),
}


def _load(name: str) -> ModelConfig:
    return ModelConfig.from_path(os.path.join(CONFIG_DIR, name))


@needs_configs
def test_every_shipped_config_is_pinned():
    shipped = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))
    assert shipped == sorted(EXPECTED), "a config file has no geometry test (or a test has no file)"


@needs_configs
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_geometry(name):
    exp = EXPECTED[name]
    cfg = _load(name)
    assert cfg.num_hidden_layers == exp["layers"] == len(cfg.layer_kinds)
    assert cfg.num_key_value_heads == exp["kv"]
    assert (cfg.head_dim, cfg.v_head_dim) == (exp["hd"], exp["vhd"])
    assert dict(Counter(cfg.layer_kinds)) == exp["kinds"]
    assert cfg.hidden_size == exp["hidden"] and cfg.vocab_size == exp["vocab"]
    assert cfg.dtype == "bfloat16"  # every shipped checkpoint is bf16 (gpt-oss: non-expert weights)
    if "full_ids" in exp:
        attn = [i for i, k in enumerate(cfg.layer_kinds) if k in (F, M)]
        assert attn == exp["full_ids"]
    if "window" in exp:
        assert cfg.sliding_window == exp["window"]
    else:
        assert cfg.sliding_window is None
    if "mla" in exp:
        assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == exp["mla"]
        assert cfg.mla_kv_dim == 576
    if "linear" in exp:
        ls = cfg.linear_state
        assert (ls.num_heads, ls.state_k_dim, ls.state_v_dim, ls.conv_channels, ls.conv_kernel) == exp["linear"]
    else:
        assert cfg.linear_state is None
    if "theta" in exp:
        assert cfg.rope_theta == pytest.approx(exp["theta"])
    if "rope_type" in exp:
        assert cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == exp["rope_type"]
    if "eos" in exp:
        assert cfg.eos_token_id == exp["eos"]
    if "max_pos" in exp:
        assert cfg.max_position_embeddings == exp["max_pos"]
    assert cfg.tie_word_embeddings == exp.get("tie", False)
    if "draft" in exp:
        assert cfg.draft is not None and cfg.is_dflash_draft
        for key, value in exp["draft"].items():
            assert getattr(cfg.draft, key) == value, key
    else:
        assert cfg.draft is None


@needs_configs
@pytest.mark.parametrize(
    "name,width,heads",
    [
        ("qwen3-8b.json", 1, 8), ("qwen3-8b.json", 4, 2), ("qwen3-8b.json", 8, 1), ("qwen3-8b.json", 16, 1),
        ("qwen3-8b-dflash-b16.json", 16, 1), ("qwen3-8b-dflash-b16.json", 1, 8),
        ("qwen3-next-80b-a3b-instruct.json", 4, 1), ("gemma-3-27b-it.json", 8, 2),
    ],
)
def test_num_kv_heads_per_width(name, width, heads):
    # max(1, total // width): heads replicate once the width exceeds them.
    assert _load(name).get_num_kv_heads(width) == heads


@needs_configs
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_agrees_with_transformers_config_class(name):
    """Where transformers has the architecture, its own config class must agree with our geometry."""
    transformers = pytest.importorskip("transformers")
    with open(os.path.join(CONFIG_DIR, name)) as f:
        raw = json.load(f)
    try:
        hf = transformers.AutoConfig.for_model(**raw)
    except ValueError as e:  # kimi_k2 is remote code: transformers does not register it
        pytest.skip(f"transformers does not know {raw.get('model_type')}: {e}")
    text = hf.get_text_config()
    cfg = _load(name)
    assert cfg.num_key_value_heads == text.num_key_value_heads
    assert cfg.num_hidden_layers == text.num_hidden_layers
    assert cfg.tie_word_embeddings == bool(hf.tie_word_embeddings)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        ours = ["sliding_attention" if k == S else "linear_attention" if k == L else "full_attention" for k in cfg.layer_kinds]
        assert ours == list(layer_types)
    if cfg.kv_lora_rank is None and getattr(text, "head_dim", None) is not None and not cfg.is_hybrid_linear:
        assert cfg.head_dim == text.head_dim


@needs_configs
def test_dflash_default_target_layer_rule_matches_the_dflash_package():
    dflash_model = pytest.importorskip("dflash.model")
    for n_target, n_draft in [(36, 5), (32, 5), (40, 5), (4, 2), (28, 1), (36, 3)]:
        assert build_target_layer_ids(n_target, n_draft) == list(dflash_model.build_target_layer_ids(n_target, n_draft))
    # README: z-lab/dflash build_target_layer_ids(36, 5) gives the b16 draft's shipped ids.
    assert build_target_layer_ids(36, 5) == _load("qwen3-8b-dflash-b16.json").draft.target_layer_ids


# ------------------------------------------------------------------ spellings (tiny hand-written configs)

BASE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _with(**changes):
    d = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_rope_theta_4x_and_5x_spellings_agree():
    v4 = ModelConfig.from_dict(_with(rope_theta=12345.0, rope_scaling=None))
    v5 = ModelConfig.from_dict(_with(rope_parameters={"rope_theta": 12345.0, "rope_type": "default"}))
    assert v4.rope_theta == v5.rope_theta == 12345.0
    assert v4.rope_scaling is None and v5.rope_scaling is None
    scaled = ModelConfig.from_dict(_with(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 4.0}))
    assert scaled.rope_scaling["factor"] == 4.0


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value,expected", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32")])
def test_dtype_4x_and_5x_spellings(key, value, expected):
    assert ModelConfig.from_dict(_with(**{key: value})).dtype == expected


def test_nested_text_config_is_read():
    text = dict(_with(), model_type="qwen3")
    wrapped = {"architectures": ["SomeVLForConditionalGeneration"], "model_type": "some_vl", "text_config": text, "torch_dtype": "float16"}
    cfg = ModelConfig.from_dict(wrapped)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype) == (2, 2, 16, "float16")
    assert cfg.architectures == ["SomeVLForConditionalGeneration"]


def test_transformers_save_pretrained_round_trip(tmp_path):
    """A tiny config written by transformers itself (5.x spelling) parses to the same geometry."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_path(str(tmp_path))
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (3, 2, 16, 512)
    assert cfg.layer_kinds == [F, F, F] and cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.get_num_kv_heads(4) == 1


def test_sliding_window_disabled_by_use_sliding_window_false():
    d = _with(layer_types=["sliding_attention", "full_attention"], sliding_window=32, use_sliding_window=False)
    assert ModelConfig.from_dict(d).layer_kinds == [F, F]
    on = ModelConfig.from_dict(_with(layer_types=["sliding_attention", "full_attention"], sliding_window=32))
    assert on.layer_kinds == [S, F] and on.sliding_window == 32


def test_dflash_draft_default_target_layers_from_num_target_layers():
    d = _with(architectures=["DFlashDraftModel"], num_target_layers=8, dflash_config={"block_size": 4, "mask_token_id": 511})
    draft = ModelConfig.from_dict(d).draft
    # Two draft layers over an 8-layer target: spread over [1, L-3] = [1, 5].
    assert (draft.algorithm, draft.block_size, draft.mask_token_id, draft.target_layer_ids) == ("DFLASH", 4, 511, [1, 5])


@pytest.mark.parametrize(
    "raw,message",
    [
        (_with(num_hidden_layers=None), "num_hidden_layers"),
        (_with(layer_types=["full_attention"]), "layer_types"),
        (_with(layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
        (_with(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (_with(architectures=["DFlashDraftModel"]), "target_layer_ids"),
        (_with(architectures=["Qwen3DSparkModel"], target_layer_ids=[0]), "markov_rank"),
    ],
)
def test_unresolvable_configs_fail_loudly(raw, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)
