"""The embedded default pair loads with the public libraries (transformers, z-lab dflash) and is well formed:
tokenizer specials and ChatML template, draft config in the public DFlash format, weight names, and greedy
speculative decoding with the dflash reference loop equals the target's own greedy decoding."""

import json
from pathlib import Path

import pytest
import torch

from sglite.testing.scripts import load_script
from sglite.testing.greedy_margin import assert_clear_greedy_margins

SUITE = "unit-cpu"
EST_TIME = 15

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
ASSETS = REPO / "python" / "sglite" / "assets"
MODEL_DIR = ASSETS / "default_model"
DRAFT_DIR = ASSETS / "default_draft"


def _train_module():
    return load_script(REPO / "scripts" / "train_default_pair.py")


def test_tokenizer_specials_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")}
    assert len(set(ids.values())) == 4 and all(i < len(tok) for i in ids.values())
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    src = "def f(x):\n    return x  # ok\n"
    assert tok.decode(tok.encode(src, add_special_tokens=False)) == src


def test_draft_config_and_weights_are_public_format():
    from dflash.model import build_target_layer_ids
    from safetensors import safe_open
    from transformers import AutoTokenizer

    target_cfg = json.loads((MODEL_DIR / "config.json").read_text())
    cfg = json.loads((DRAFT_DIR / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    dc = cfg["dflash_config"]
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert dc["block_size"] == 8
    assert dc["mask_token_id"] == tok.convert_tokens_to_ids("<|MASK|>") < target_cfg["vocab_size"]
    assert cfg["num_target_layers"] == target_cfg["num_hidden_layers"]
    assert dc["target_layer_ids"] == build_target_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])
    assert cfg["hidden_size"] == target_cfg["hidden_size"]
    with safe_open(str(DRAFT_DIR / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n.startswith("layers.") for n in names - {"fc.weight", "hidden_norm.weight", "norm.weight"})
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_dflash_reference_greedy_equals_target_greedy():
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    target = Qwen3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(DRAFT_DIR, dtype=torch.float32, attn_implementation="sdpa").eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function `add`: Return a + b."}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    spec = dflash_generate(draft, target, ids, max_new_tokens=40, stop_token_ids=[tok.eos_token_id], temperature=0.0)
    with torch.inference_mode():
        ref = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    ref_out = ref[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in ref_out:
        ref_out = ref_out[: ref_out.index(tok.eos_token_id) + 1]
    assert_clear_greedy_margins(target, [ids[0].tolist()], [ref_out])  # exact equality needs no near-ties
    assert spec[0, ids.shape[1]:].tolist() == ref_out


def test_heldout_split_is_by_file_and_stable():
    mod = _train_module()
    root = mod.stdlib_root()
    files = mod.list_corpus_files(root)
    held = [f for f in files if mod.is_heldout(f, 5)]
    assert 0 < len(held) < len(files) // 10
    assert held == [f for f in sorted(files, reverse=True) if mod.is_heldout(f, 5)][::-1]  # order-independent


def test_draft_batch_mask_matches_inference_attention():
    """Block queries see context positions < anchor and their own block only (dflash_generate's attention)."""
    mod = _train_module()
    cfg = mod.PairConfig(block_size=4, blocks_per_seq=3, draft_batch_size=2)
    tokens = [torch.arange(100, 140), torch.arange(200, 230)]
    data = mod.DraftData(tokens=tokens, features=[torch.zeros(len(t), 6) for t in tokens], prompt_lens=[10, 5], valid_lens=[40, 20])
    batch = mod.sample_draft_batch(data, cfg, mask_id=3, gen=torch.Generator().manual_seed(0))
    T = batch.target_hidden.shape[1]
    for n in range(2):
        for k in range(3):
            anchor = int(batch.position_ids[n, T + 4 * k])
            tok = batch.block_ids[n, 4 * k]
            row = next(i for i, t in enumerate(tokens) if t.numel() > anchor and int(t[anchor]) == int(tok))
            assert batch.block_ids[n, 4 * k + 1: 4 * k + 4].tolist() == [3, 3, 3]
            assert batch.position_ids[n, T + 4 * k: T + 4 * k + 4].tolist() == list(range(anchor, anchor + 4))
            for q in range(4 * k, 4 * k + 4):
                seen = batch.attention_mask[n, 0, q].nonzero().flatten().tolist()
                assert seen == list(range(anchor)) + list(range(T + 4 * k, T + 4 * k + 4))
            for j in range(1, 4):
                want = int(tokens[row][anchor + j]) if anchor + j < data.valid_lens[row] else -100
                assert int(batch.labels[n, k, j - 1]) == want
