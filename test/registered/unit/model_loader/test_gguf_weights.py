"""GGUF checkpoints: tiny llama / qwen2 / qwen3 written to GGUF here (F32, Q8_0, Q4_1) load in sglite and
equal transformers loading the same file (logits, greedy tokens), at TP 1 and TP 2; clear start-up errors."""

import os
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from sglite.srt.configs.gguf import GGUFError, find_gguf_file, resolved_load_format
from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.local_launch import run_local_ranks
from sglite.srt.entrypoints.preflight import check_load_format, check_model_dir
from sglite.srt.managers.detokenizer_manager import load_tokenizer
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.model_loader.gguf_weights import iterate_gguf, unpermute_rope_rows
from sglite.srt.server_args import ServerArgs, ServerArgsError
from sglite.testing.fp32_reference import float64_copy, fp32_atol
from sglite.testing.runner_generate import assert_decodes_like, greedy_generate, hf_greedy
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.tiny_gguf import permute_rope_rows, write_gguf
from sglite.testing.tiny_models import build_tiny_model

SUITE = "unit-cpu"
EST_TIME = 90

PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42]]
# transformers' GGUF config mapping for qwen3 ignores attention.key_length and builds head_dim 128,
# so the qwen3 model is written with head_dim 128 (real Qwen3 checkpoints have it too).
ARCH_OVERRIDES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """GGUF metadata folders go to the test's tmp dir, not ~/.cache."""
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))


def _write(tmp_path, arch: str, quant: str, tokenizer: bool = False) -> str:
    """A tiny random ``arch`` model as a GGUF folder; returns the folder.

    Without the tokenizer the file has no eos, so greedy runs never stop (nor ban an eos) on either side."""
    hf_dir, gguf_dir = str(tmp_path / f"{arch}_hf"), str(tmp_path / f"{arch}_{quant}")
    build_tiny_model(hf_dir, arch, seed=5, eos_token_id=None, num_hidden_layers=2, **ARCH_OVERRIDES[arch])
    os.makedirs(gguf_dir)
    write_gguf(hf_dir, os.path.join(gguf_dir, "model.gguf"), quant, tokenizer=tokenizer)
    return gguf_dir


def _hf_from_gguf(gguf_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="model.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _greedy_reference(hf, prompts, n):
    out = hf_greedy(hf, prompts, n)
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(hf, prompts, out)
    return out


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_gguf_matches_transformers_on_the_same_file(arch, quant, tmp_path, rank0):
    d = _write(tmp_path, arch, quant)
    hf = _hf_from_gguf(d)
    args = ServerArgs(model_path=d, device="cpu", cpu_kv_cache_budget_mb=2).validate()
    runner = ModelRunner(args)
    assert runner.model_config.architectures == [type(hf).__name__]
    assert_decodes_like(runner, hf, PROMPTS, 16)


@pytest.mark.parametrize("quant", ["F32", "F16", "Q8_0", "Q4_1"])
def test_gguf_weights_equal_transformers_dequantization(tmp_path, quant):
    """Every tensor, after dequantizing and undoing llama's Q/K permutation, is bit-equal to transformers'."""
    d = _write(tmp_path, "llama", quant)
    ours = dict(iterate_gguf(find_gguf_file(d), ModelConfig.from_path(d), torch.float32))
    theirs = _hf_from_gguf(d).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_rope_permutation_round_trips():
    w = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)
    permuted = permute_rope_rows(w, n_head=2)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(permuted[:2], w[[0, 4]])  # head 0: rows x0, y0 interleaved
    assert np.array_equal(unpermute_rope_rows(permuted, n_head=2), w)


def _tp_rank(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    args = ServerArgs(model_path=model_dir, device="cpu", tp_size=world_size, cpu_kv_cache_budget_mb=2).validate()
    runner = ModelRunner(args, rank=rank, world_size=world_size, dist_init_method=init_method)
    rows = runner.req_to_token_pool.alloc(len(PROMPTS))
    out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, PROMPTS)]))
    runner.req_to_token_pool.free(rows)
    return {
        "local_heads": runner.model.model.layers[0].self_attn.num_heads,
        "prefill_logits": out.next_token_logits.tolist(),
        "greedy": greedy_generate(runner, PROMPTS, 16),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch,quant", [("llama", "Q4_1"), ("qwen3", "Q8_0")])
@torch.no_grad()
def test_gguf_tp2_matches_transformers(arch, quant, tmp_path):
    torch.set_num_threads(1)
    d = _write(tmp_path, arch, quant)
    hf = _hf_from_gguf(d)
    ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    exact = torch.stack([float64_copy(hf)(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    expected = _greedy_reference(hf, PROMPTS, 16)
    for res in run_local_ranks(_tp_rank, 2, d, timeout_s=200):
        assert res["local_heads"] == 2  # 4 query heads split over 2 ranks, after dequantizing
        torch.testing.assert_close(
            torch.tensor(res["prefill_logits"]), ref, atol=fp32_atol(ref, exact, floor=1e-4), rtol=0
        )
        assert res["greedy"] == expected


def test_gguf_path_forms_and_load_format(tmp_path):
    d = _write(tmp_path, "qwen2", "F32", tokenizer=True)
    f = os.path.join(d, "model.gguf")
    assert find_gguf_file(d) == f and find_gguf_file(f) == f
    assert resolved_load_format(d) == "gguf"
    check_load_format(ServerArgs(model_path=f, load_format="gguf"))
    check_model_dir("--model-path", f)  # a .gguf file passes the start-up check (its metadata is the config)
    assert ModelConfig.from_path(f).architectures == ["Qwen2ForCausalLM"]
    tok = load_tokenizer(f)  # converted from the GGUF's metadata: same ids and chat template as the original
    assert tok.encode("Hello world!") == AutoTokenizer.from_pretrained(str(tmp_path / "qwen2_hf")).encode("Hello world!")
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    with pytest.raises(ServerArgsError, match="--load-format safetensors does not match"):
        check_load_format(ServerArgs(model_path=d, load_format="safetensors"))
    shutil.copy(f, os.path.join(d, "other.gguf"))
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        find_gguf_file(d)


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import gguf

    f = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(f, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="GGUF architecture 'mamba' is not supported"):
        ModelConfig.from_path(f)


def test_unknown_quant_type_is_a_clear_error(tmp_path, rank0):
    """A tensor in a quant type the gguf package cannot dequantize (Q8_1) fails at load, naming both."""
    import gguf

    d = _write(tmp_path, "qwen2", "F32")
    src = os.path.join(d, "model.gguf")
    reader = gguf.GGUFReader(src)
    bad = str(tmp_path / "bad")
    os.makedirs(bad)
    out = gguf.GGUFWriter(os.path.join(bad, "model.gguf"), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        out.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name == "blk.0.ffn_down.weight":
            rows, cols = data.shape
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
            out.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            out.add_tensor(t.name, data)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    with pytest.raises(GGUFError, match="'blk.0.ffn_down.weight' uses GGUF quant type Q8_1"):
        ModelRunner(ServerArgs(model_path=bad, device="cpu", cpu_kv_cache_budget_mb=2).validate())


@pytest.mark.parametrize("arch,quant", [("llama", "Q4_1"), ("qwen3", "Q8_0")])
def test_linears_read_their_gguf_blocks_and_they_dequantize_to_the_loaded_weights(arch, quant, tmp_path, rank0):
    """Every linear (fused q/k/v and gate/up included) and the head get the file's blocks; llama's Q/K rows in HF order."""
    from sglite.srt.layers.cpu_gguf_linear import gguf_dequantize, gguf_kernel_available

    if not gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    d = _write(tmp_path, arch, quant)
    runner = ModelRunner(ServerArgs(model_path=d, device="cpu", cpu_kv_cache_budget_mb=2).validate())
    with_blocks = {name: m for name, m in runner.model.named_modules() if getattr(m, "packed_weight", None) is not None}
    layers = runner.model_config.num_hidden_layers
    assert len(with_blocks) == 4 * layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    for name, module in with_blocks.items():
        packed = module.packed_weight
        assert packed.gguf is not None and packed.gguf.type_name == quant, name
        assert torch.equal(gguf_dequantize(packed.gguf), module.weight), name
        assert packed.gguf_rows == runner.cpu_pack.gguf_rows != 0


def test_f32_gguf_linears_keep_their_fp32_route(tmp_path, rank0):
    d = _write(tmp_path, "qwen2", "F32")
    runner = ModelRunner(ServerArgs(model_path=d, device="cpu", cpu_kv_cache_budget_mb=2).validate())
    packed = [m.packed_weight for m in runner.model.modules() if getattr(m, "packed_weight", None) is not None]
    assert packed and all(p.gguf is None and p.gguf_rows == 0 for p in packed)


def test_blocks_that_do_not_match_the_loaded_weight_are_an_error(tmp_path, rank0):
    """A wrong mapping from blocks to a fused weight fails at load, never as wrong logits."""
    from sglite.srt.layers.cpu_gguf_linear import gguf_kernel_available
    from sglite.srt.model_loader.gguf_weights import attach_gguf_blocks

    if not gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    d = _write(tmp_path, "llama", "Q8_0")
    runner = ModelRunner(ServerArgs(model_path=d, device="cpu", cpu_kv_cache_budget_mb=2).validate())
    model, config = runner.model, runner.model_config
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.gguf_weight is not None
    qkv.weight.data[0, 0] += 1.0
    with pytest.raises(GGUFError, match="model.layers.0.self_attn.qkv_proj.weight do not dequantize"):
        attach_gguf_blocks(model, find_gguf_file(d), config)


def test_q8_0_rounding_gives_a_models_linears_blocks_that_dequantize_to_its_weights():
    """--speculative-draft-model-quantization q8_0: each fp32 linear whose rows split into 32-weight blocks gets Q8_0
    blocks the GGUF kernel reads, and its fp32 weight becomes exactly what they dequantize to (every route computes
    with the same weights); rows of other widths, and blocks a linear already reads, are left alone."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from sglite.srt.layers.cpu_gguf_linear import GGUFWeight, gguf_dequantize, gguf_kernel_available
    from sglite.srt.layers.linear import ReplicatedLinear
    from sglite.srt.model_loader.gguf_weights import quantize_linears_to_q8_0

    if not gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "a": ReplicatedLinear(64, 96, bias=False), "b": ReplicatedLinear(128, 32, bias=True),
        "odd": ReplicatedLinear(48, 16, bias=False), "kept": ReplicatedLinear(32, 8, bias=False),
    })
    for m in model.values():
        m.weight.data.normal_()
    kept = GGUFWeight(torch.zeros(8, 34, dtype=torch.uint8), 8, 32)
    model["kept"].gguf_weight = kept
    originals = {k: m.weight.detach().clone() for k, m in model.items()}
    assert quantize_linears_to_q8_0(model) == 2
    for key in ("a", "b"):
        m = model[key]
        assert m.gguf_weight.type_name == "Q8_0" and m.gguf_weight.out_features == m.weight.shape[0]
        assert torch.equal(gguf_dequantize(m.gguf_weight), m.weight)
        want = dequantize(quantize(originals[key].numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        assert torch.equal(m.weight, torch.from_numpy(want))  # the gguf package's own Q8_0 rounding
        assert 0 < (m.weight - originals[key]).abs().max() < 0.02 * originals[key].abs().max()
    assert getattr(model["odd"], "gguf_weight", None) is None and torch.equal(model["odd"].weight, originals["odd"])
    assert model["kept"].gguf_weight is kept and torch.equal(model["kept"].weight, originals["kept"])


def test_the_draft_weights_default_to_q8_0_for_the_bundled_draft_on_cpu(monkeypatch):
    import sglite.srt.model_loader.gguf_weights as gw
    from sglite.srt.default_model import DEFAULT_DRAFT_DIR

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(gw, "gguf_kernel_available", lambda: True)
    assert gw.draft_model_quantization(None, DEFAULT_DRAFT_DIR, cpu) == "q8_0"
    assert gw.draft_model_quantization(None, DEFAULT_DRAFT_DIR, cuda) is None
    assert gw.draft_model_quantization(None, "/some/other/draft", cpu) is None  # a draft you name keeps its weights
    assert gw.draft_model_quantization("none", DEFAULT_DRAFT_DIR, cpu) is None
    assert gw.draft_model_quantization("q8_0", "/some/other/draft", cpu) == "q8_0"
    monkeypatch.setattr(gw, "gguf_kernel_available", lambda: False)  # no kernel (not x86, no compiler)
    assert gw.draft_model_quantization(None, DEFAULT_DRAFT_DIR, cpu) is None


def test_q8_0_without_the_gguf_kernel_is_a_clear_error(monkeypatch):
    import sglite.srt.model_loader.gguf_weights as gw

    monkeypatch.setattr(gw, "gguf_kernel_available", lambda: False)
    with pytest.raises(GGUFError, match="needs the GGUF kernel"):
        gw.quantize_linears_to_q8_0(torch.nn.Linear(32, 8))
