"""MoE GGUF checkpoints (llama.cpp's ``qwen3moe`` and ``deepseek2``): tiny Qwen3-MoE and DeepSeek-V3 models written
to GGUF here in llama.cpp's layout (stacked experts, split MLA kv_b, router bias) load in sglite and decode greedily
token for token like transformers on the safetensors original, and like transformers on the same file where
transformers reads the architecture (qwen3moe; it has no deepseek2 GGUF support). Quantized (Q8_0) files decode like
transformers on the same weights: the file itself for qwen3moe, the original model with the file's dequantized
weights for deepseek2, once those are checked to be the original's own Q8_0 / F16 round trip."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglite.srt.configs.gguf import GGUFError, find_gguf_file, gguf_metadata_dir
from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.layers.cpu_gguf_linear import gguf_kernel_available
from sglite.srt.managers.detokenizer_manager import load_tokenizer
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.model_loader.gguf_names import join_kv_b, to_hf_tensors
from sglite.srt.model_loader.gguf_weights import iterate_gguf
from sglite.srt.server_args import ServerArgs
from sglite.testing.runner_generate import assert_decodes_like
from sglite.testing.tiny_gguf import write_gguf
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 60

PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42]]
# transformers' qwen3moe GGUF mapping drops expert_feed_forward_length and builds Qwen3MoeConfig's default expert
# width, 768 (Qwen3-30B-A3B's), so a file transformers is to read must have it.
TRANSFORMERS_READABLE = {"qwen3_moe": {"moe_intermediate_size": 768}}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """GGUF metadata folders go to the test's tmp dir, not ~/.cache."""
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))


def _write(tmp_path, arch: str, quant: str, tokenizer: bool = False, split_kv_b: bool = True, **overrides) -> tuple:
    """A tiny random ``arch`` model (2 layers; DeepSeek's layer 0 dense) and its GGUF folder: (hf dir, gguf dir).

    Without the tokenizer the file has no eos, so greedy runs never stop (nor ban an eos) on either side."""
    tag = f"{arch}_{quant}_{int(split_kv_b)}"
    hf_dir, gguf_dir = str(tmp_path / f"{tag}_hf"), str(tmp_path / tag)
    build_tiny_model(hf_dir, arch, seed=5, eos_token_id=None, num_hidden_layers=2, **overrides)
    os.makedirs(gguf_dir)
    write_gguf(hf_dir, os.path.join(gguf_dir, "model.gguf"), quant, tokenizer=tokenizer, split_kv_b=split_kv_b)
    return hf_dir, gguf_dir


def _runner(gguf_dir: str) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=gguf_dir, device="cpu", cpu_kv_cache_budget_mb=2).validate())


@pytest.mark.parametrize(
    "arch,split_kv_b", [("qwen3_moe", True), ("deepseek_v3", True), ("deepseek_v3", False)],
    ids=["qwen3moe", "deepseek2", "deepseek2-unsplit-kv_b"],
)
def test_f32_gguf_decodes_like_transformers_on_the_original(arch, split_kv_b, tmp_path, rank0):
    """The file's tensors are the original's, bit for bit, after splitting experts and joining kv_b; the model
    decodes like transformers on the safetensors original (qwen3moe at expert width 32: read from the metadata)."""
    hf_dir, d = _write(tmp_path, arch, "F32", split_kv_b=split_kv_b)
    config = ModelConfig.from_path(d)
    original = ModelConfig.from_path(hf_dir)
    assert config.architectures == original.architectures
    assert (config.moe, config.head_dim, config.v_head_dim, config.kv_lora_rank, config.qk_rope_head_dim) == (
        original.moe, original.head_dim, original.v_head_dim, original.kv_lora_rank, original.qk_rope_head_dim
    )
    ours = dict(iterate_gguf(find_gguf_file(d), config, torch.float32))
    stored = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert set(ours) == set(stored)
    for name, tensor in ours.items():
        assert torch.equal(tensor, stored[name]), name
    assert_decodes_like(_runner(d), load_hf_model(hf_dir), PROMPTS, 16)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_qwen3moe_gguf_decodes_like_transformers_on_the_same_file(quant, tmp_path, rank0):
    _, d = _write(tmp_path, "qwen3_moe", quant, **TRANSFORMERS_READABLE["qwen3_moe"])
    hf = AutoModelForCausalLM.from_pretrained(
        d, gguf_file="model.gguf", dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    runner = _runner(d)
    assert runner.model_config.architectures == [type(hf).__name__]
    if quant == "Q8_0" and gguf_kernel_available():  # attention and head read their blocks (not experts, F32 router)
        with_blocks = {n for n, m in runner.model.named_modules() if getattr(m, "gguf_weight", None) is not None}
        attention = {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("qkv_proj", "o_proj")}
        assert with_blocks == attention | {"lm_head"}
    assert_decodes_like(runner, hf, PROMPTS, 16)


def _llama_cpp_round_trip(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    """What a Q8_0 llama.cpp conversion of original tensor ``w`` dequantizes to: 1-D tensors and the router kept F32,
    rows that 32-weight blocks do not divide F16, the rest Q8_0; kv_b per part (its key part is stored transposed,
    with rows of qk_nope_head_dim, its value part with rows of kv_lora_rank)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    def trip(x: np.ndarray) -> np.ndarray:
        kind = Q.Q8_0 if x.shape[-1] % 32 == 0 else Q.F16
        return dequantize(quantize(x, kind), kind)

    x = w.numpy()
    if x.ndim == 1 or name.endswith("mlp.gate.weight"):
        return w
    if name.endswith("kv_b_proj.weight"):
        heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
        per_head = x.reshape(heads, -1, x.shape[-1])
        k_b = trip(np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)))
        return torch.from_numpy(join_kv_b(k_b, trip(np.ascontiguousarray(per_head[:, nope:]))))
    return torch.from_numpy(trip(x).reshape(x.shape))


def test_deepseek2_q8_0_gguf_decodes_like_transformers_on_its_weights(tmp_path, rank0):
    """transformers cannot read a deepseek2 GGUF: the reference is the original model with the file's dequantized
    weights, each first checked to be the original's own llama.cpp-style Q8_0 / F16 round trip."""
    hf_dir, d = _write(tmp_path, "deepseek_v3", "Q8_0")
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    ours = dict(iterate_gguf(find_gguf_file(d), ModelConfig.from_path(d), torch.float32))
    stored = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert set(ours) == set(stored)
    changed = 0
    for name, tensor in ours.items():
        assert torch.equal(tensor, _llama_cpp_round_trip(name, stored[name], config)), name
        changed += not torch.equal(tensor, stored[name])
    assert changed > 20  # the file is quantized: most matrices moved
    hf = load_hf_model(hf_dir)
    hf.load_state_dict(_as_hf_params(ours, hf.state_dict()))
    assert_decodes_like(_runner(d), hf, PROMPTS, 16)


def _as_hf_params(ours: dict, reference: dict) -> dict:
    """Our checkpoint-named (per-expert) tensors under the reference's parameter names: transformers fuses each
    layer's experts as ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    out = {}
    for name, param in reference.items():
        experts = range(param.shape[0])
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate_up = [torch.cat([ours[f"{prefix}{e}.{p}_proj.weight"] for p in ("gate", "up")]) for e in experts]
            out[name] = torch.stack(gate_up)
        elif name.endswith("mlp.experts.down_proj"):
            out[name] = torch.stack([ours[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] for e in experts])
        else:
            out[name] = ours[name]
    return out


def test_deepseek2_config_and_tokenizer_from_the_metadata(tmp_path, rank0):
    """Every field the models read equals the original config's (transformers has no deepseek2 mapping to agree
    with), YaRN rope included, and the model decodes like the original; the tokenizer converted from the file
    encodes like the original's."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    hf_dir, d = _write(tmp_path, "deepseek_v3", "F32", tokenizer=True, rope_parameters=yarn)
    with open(os.path.join(hf_dir, "config.json")) as f:
        want = json.load(f)
    with open(os.path.join(gguf_metadata_dir(find_gguf_file(d)), "config.json")) as f:
        got = json.load(f)
    fields = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "max_position_embeddings", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "n_routed_experts",
              "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "n_group",
              "topk_group", "routed_scaling_factor", "tie_word_embeddings", "architectures")
    assert {k: got[k] for k in fields} == {k: want[k] for k in fields}
    assert got["scoring_func"] == "sigmoid"  # DeepSeek-V3's router (transformers' saves no key for it)
    rope = got["rope_parameters"]
    for key, value in yarn.items():
        assert rope[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-6)), key
    config, original = ModelConfig.from_path(d), ModelConfig.from_path(hf_dir)
    assert (config.rope_theta, config.rope_scaling.keys()) == (original.rope_theta, original.rope_scaling.keys())
    assert config.moe == original.moe and config.eos_token_id == [2]
    tok = load_tokenizer(d)
    text = "Hello world! <|im_start|>user"
    assert tok.encode(text) == AutoTokenizer.from_pretrained(hf_dir).encode(text)
    assert_decodes_like(_runner(d), load_hf_model(hf_dir), PROMPTS, 16)  # the original has no eos: no stop on either side


def test_qwen3moe_metadata_folder_is_transformers_conversion_plus_the_expert_width(tmp_path):
    """Our qwen3moe folder is byte for byte transformers' own conversion of the file (config as sglite serves it,
    tokenizer files), and the expert width its mapping drops comes from the metadata."""
    from transformers import AutoConfig

    from sglite.srt.configs import gguf
    from sglite.srt.configs.gguf_header import read_gguf_header

    _, d = _write(tmp_path, "qwen3_moe", "Q8_0", tokenizer=True)
    f = find_gguf_file(d)
    ours = gguf_metadata_dir(f)
    ref = str(tmp_path / "ref")
    os.makedirs(ref)
    config = AutoConfig.from_pretrained(d, gguf_file="model.gguf").to_dict()
    assert config["moe_intermediate_size"] == 768  # transformers' default, not the file's
    with open(os.path.join(ref, "config.json"), "w") as out:
        json.dump(gguf._served_config(config, gguf._file_facts(read_gguf_header(f))), out, indent=2, sort_keys=True)
    AutoTokenizer.from_pretrained(d, gguf_file="model.gguf").save_pretrained(ref)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(ref))
    for name in os.listdir(ref):
        with open(os.path.join(ours, name), "rb") as a, open(os.path.join(ref, name), "rb") as b:
            assert a.read() == b.read(), name
    served = json.load(open(os.path.join(ours, "config.json")))
    assert served["moe_intermediate_size"] == 32 and served["norm_topk_prob"] is True
    assert served["architectures"] == ["Qwen3MoeForCausalLM"]


def test_kv_b_split_round_trips():
    """llama.cpp's split (per head: key part transposed, value part as is) and ``join_kv_b`` are inverses; a file
    with one half of the pair is a clear error."""
    heads, nope, v, kv_lora = 3, 4, 5, 6
    kv_b = np.arange(heads * (nope + v) * kv_lora, dtype=np.float32).reshape(heads * (nope + v), kv_lora)
    per_head = kv_b.reshape(heads, nope + v, kv_lora)
    k_b, v_b = per_head[:, :nope].transpose(0, 2, 1), per_head[:, nope:]
    assert k_b.shape == (heads, kv_lora, nope) and v_b.shape == (heads, v, kv_lora)
    assert np.array_equal(join_kv_b(k_b, v_b), kv_b)
    with pytest.raises(GGUFError, match="m.gguf: blk.0 has only one of attn_k_b / attn_v_b"):
        list(to_hf_tensors([("blk.0.attn_k_b.weight", k_b.shape)], {}, lambda name, index: k_b, "m.gguf"))
