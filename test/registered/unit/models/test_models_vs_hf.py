"""Every served target family on the paged KV pool equals transformers on the same tiny random weights.

The MoE families (Qwen3-MoE; DeepSeek-V3 with MLA over the latent pool) run the same tests as the dense ones."""

import weakref
from typing import Optional

import pytest
import torch

from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.server_args import ServerArgs
from sglite.testing.fp32_reference import float64_copy, fp32_atol
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.runner_generate import greedy_generate
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 75

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42]]
SHARED = [11, 12, 13, 14, 15, 16, 17, 18]
SHARED_PROMPTS = [SHARED + [200, 201, 202], SHARED + [7], SHARED + list(range(300, 310)), SHARED + [9, 9]]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    # 3 layers, GQA 4/2, fp32; eos None so HF generate never stops early.
    build_tiny_model(d, request.param, seed=7, with_tokenizer=False, eos_token_id=None, num_hidden_layers=3)
    return request.param, d, load_hf_model(d)


_EXACT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def exact_of(hf):
    """The fixture model's float64 copy (cached): the exact result that calibrates fp32 tolerances."""
    if hf not in _EXACT:
        _EXACT[hf] = float64_copy(hf)
    return _EXACT[hf]


def make_runner(model_dir: str, page_size: int = 1, **kw) -> ModelRunner:
    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=2, page_size=page_size, **kw).validate()
    return ModelRunner(args)


def hf_greedy(hf, prompts, n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        out.append(ids[0, len(p) :].tolist())
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(hf, prompts, out)
    return out


@torch.no_grad()
def test_prefill_logits_match_hf(tiny, rank0):
    arch, d, hf = tiny
    runner = make_runner(d)
    rows = runner.req_to_token_pool.alloc(len(PROMPTS))
    out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, list(zip(rows, [0] * 4, PROMPTS))))
    assert out.next_token_logits.shape == (len(PROMPTS), 512)
    for i, p in enumerate(PROMPTS):
        ref = hf(torch.tensor([p])).logits[0, -1]
        exact = exact_of(hf)(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(out.next_token_logits[i], ref, atol=fp32_atol(ref, exact, floor=1e-4), rtol=0)


@pytest.mark.parametrize("page_size,shared", [(1, False), (1, True), (4, True)])
def test_greedy_32_tokens_match_hf_generate(tiny, rank0, page_size, shared):
    arch, d, hf = tiny
    prompts = SHARED_PROMPTS if shared else PROMPTS
    expected = hf_greedy(hf, prompts, 32)
    # A random model with a wide init must not be degenerate, or the comparison says little.
    assert all(len(set(e)) > 4 for e in expected)
    runner = make_runner(d, page_size=page_size)
    got = greedy_generate(runner, prompts, 32, shared_prefix_len=len(SHARED) if shared else 0)
    assert got == expected


@torch.no_grad()
def test_target_verify_and_draft_block_logits(tiny, rank0):
    """VERIFY = causal logits for every block token; DRAFT_BLOCK = non-causal (a full-attention reference)."""
    arch, d, hf = tiny
    runner = make_runner(d)
    prompt, block = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8]
    row = runner.req_to_token_pool.alloc(1)[0]
    runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(row, 0, prompt)]))
    out = runner.forward(runner.build_forward_batch(ForwardMode.TARGET_VERIFY, [(row, len(prompt), block)]))
    ref = hf(torch.tensor([prompt + block])).logits[0, len(prompt) :]
    exact = exact_of(hf)(torch.tensor([prompt + block])).logits[0, len(prompt) :]
    assert out.next_token_logits.shape == (len(block), 512)
    torch.testing.assert_close(out.next_token_logits, ref, atol=fp32_atol(ref, exact, floor=1e-4), rtol=0)

    # Non-causal block over the same prefix (slots of the verify block reused): the reference is HF with
    # a 4D mask in which the block's queries see the whole block.
    n, b = len(prompt), len(block)
    loc = runner.req_to_token_pool.req_to_token[row, n : n + b].long()
    out = runner.forward(runner.build_forward_batch(ForwardMode.DRAFT_BLOCK, [(row, n, block)], out_cache_loc=loc))
    mask = torch.tril(torch.ones(n + b, n + b, dtype=torch.bool))
    mask[n:, n:] = True
    float_mask = torch.zeros(n + b, n + b).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    ref = hf(torch.tensor([prompt + block]), attention_mask=float_mask).logits[0, n:]
    exact = exact_of(hf)(torch.tensor([prompt + block]), attention_mask=float_mask.double()).logits[0, n:]
    torch.testing.assert_close(out.next_token_logits, ref, atol=fp32_atol(ref, exact, floor=1e-4), rtol=0)
    causal = hf(torch.tensor([prompt + block])).logits[0, n:]
    assert (out.next_token_logits[:-1] - causal[:-1]).abs().max() > 1e-2  # the mask really differs


@torch.no_grad()
def test_aux_hidden_states_are_layer_outputs(tiny, rank0):
    arch, d, hf = tiny
    runner = make_runner(d)
    prompts = [[9, 8, 7, 6, 5], [1, 2, 3]]
    rows = runner.req_to_token_pool.alloc(2)
    batch = runner.build_forward_batch(
        ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)], capture_aux_hidden_layers=[1, 0]
    )
    out = runner.forward(batch)
    assert out.aux_hidden_states.shape == (8, 2 * 64)
    start = 0
    for p in prompts:
        hs = hf(torch.tensor([p]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[2][0], hs[1][0]], dim=-1)  # DFlash rule: hidden_states[layer_id + 1]
        hs64 = exact_of(hf)(torch.tensor([p]), output_hidden_states=True).hidden_states
        exact = torch.cat([hs64[2][0], hs64[1][0]], dim=-1)
        # Hidden states reach |h| ~ 60 here, where fp32 itself errs by several 1e-5: atol from that error.
        torch.testing.assert_close(out.aux_hidden_states[start : start + len(p)], want,
                                   atol=fp32_atol(want, exact, floor=1e-4), rtol=0)
        start += len(p)
    # hidden_states are the final normed states of the logits rows.
    assert out.hidden_states.shape == (2, 64)


@torch.no_grad()
def test_input_embeds_replace_the_lookup(tiny, rank0):
    arch, d, hf = tiny
    runner = make_runner(d)
    prompt = [4, 8, 15, 16, 23, 42]
    row = runner.req_to_token_pool.alloc(1)[0]
    embeds = runner.model.get_embed_tokens()(torch.tensor(prompt)) * 0.5
    batch = runner.build_forward_batch(ForwardMode.EXTEND, [(row, 0, prompt)], input_embeds=embeds)
    out = runner.forward(batch)
    ref = hf(inputs_embeds=embeds[None]).logits[0, -1]
    exact = exact_of(hf)(inputs_embeds=embeds[None].double()).logits[0, -1]
    torch.testing.assert_close(out.next_token_logits[0], ref, atol=fp32_atol(ref, exact, floor=1e-4), rtol=0)
    assert runner.model.get_lm_head().weight.shape == (512, 64)


def test_tied_embeddings_and_llama3_rope(tmp_path, rank0):
    d = str(tmp_path / "tied")
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    build_tiny_model(d, "llama", seed=3, with_tokenizer=False, eos_token_id=None, tie_word_embeddings=True, rope_parameters=rope)
    hf = load_hf_model(d)
    assert hf.config.tie_word_embeddings
    runner = make_runner(d)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    prompts = [list(range(1, 40)), [77, 78]]
    assert greedy_generate(runner, prompts, 32) == hf_greedy(hf, prompts, 32)


def test_llama_with_attention_and_mlp_bias(tmp_path, rank0):
    d = str(tmp_path / "bias")
    build_tiny_model(d, "llama", seed=4, with_tokenizer=False, eos_token_id=None, attention_bias=True, mlp_bias=True)
    hf = load_hf_model(d)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None and hf.model.layers[0].mlp.down_proj.bias is not None
    runner = make_runner(d)
    assert runner.model.model.layers[0].self_attn.o_proj.bias is not None
    prompts = [list(range(100, 120)), [5, 6]]
    assert greedy_generate(runner, prompts, 32) == hf_greedy(hf, prompts, 32)


def test_qwen3_moe_dense_layers_by_mlp_only_layers_and_sparse_step(tmp_path, rank0):
    """Layer 0 listed in mlp_only_layers and every other layer off decoder_sparse_step 2 keep the dense MLP."""
    d = str(tmp_path / "q3moe")
    build_tiny_model(d, "qwen3_moe", seed=6, with_tokenizer=False, eos_token_id=None, num_hidden_layers=4,
                     mlp_only_layers=[1], decoder_sparse_step=2)
    hf = load_hf_model(d)
    runner = make_runner(d)
    kinds = [type(layer.mlp).__name__ for layer in runner.model.model.layers]
    assert kinds == ["LlamaMLP", "LlamaMLP", "LlamaMLP", "Qwen3MoeSparseMoeBlock"]
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == [
        "Qwen3MoeMLP", "Qwen3MoeMLP", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    prompts = [list(range(100, 120)), [5, 6], [300, 1, 2, 3]]
    assert greedy_generate(runner, prompts, 16) == hf_greedy(hf, prompts, 16)
