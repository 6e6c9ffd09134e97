"""Tensor parallelism on CPU: two gloo ranks (fork) give the same logits and greedy tokens as transformers."""

import pytest
import torch

from sglite.srt.distributed.local_launch import run_local_ranks
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.server_args import ServerArgs
from sglite.testing.fp32_reference import float64_copy, fp32_atol
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.runner_generate import greedy_generate
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 60

PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42]]
SHARED = [11, 12, 13, 14, 15, 16, 17, 18]
SHARED_PROMPTS = [SHARED + [200, 201, 202], SHARED + [7], SHARED + list(range(300, 310))]


def _rank_main(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    from sglite.srt.distributed.parallel_state import get_tp_group
    from sglite.srt.model_executor.model_runner import ModelRunner

    args = ServerArgs(model_path=model_dir, device="cpu", tp_size=world_size, cpu_kv_cache_budget_mb=2).validate()
    runner = ModelRunner(args, rank=rank, world_size=world_size, dist_init_method=init_method)
    attn = runner.model.model.layers[0].self_attn
    rows = runner.req_to_token_pool.alloc(len(PROMPTS))
    out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, PROMPTS)]))
    result = {
        "tp_world": get_tp_group().world_size,
        "local_heads": (attn.num_heads, attn.num_kv_heads),
        "kv_pool_heads": runner.token_to_kv_pool.head_num,
        "local_vocab_rows": runner.model.lm_head.weight.shape[0],
        "prefill_logits": out.next_token_logits.tolist(),  # plain lists: tensors would travel by shared memory
        "greedy": greedy_generate(runner, PROMPTS, 32),
        "greedy_shared": greedy_generate(runner, SHARED_PROMPTS, 32, shared_prefix_len=len(SHARED)),
    }
    return result


def _hf_greedy(hf, prompts, n):
    out = [
        hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(hf, prompts, out)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_transformers(arch, tmp_path):
    torch.set_num_threads(1)
    d = str(tmp_path / arch)
    build_tiny_model(d, arch, seed=11, with_tokenizer=False, eos_token_id=None, num_hidden_layers=2)
    hf = load_hf_model(d)
    with torch.no_grad():
        ref_logits = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        hf64 = float64_copy(hf)
        exact = torch.stack([hf64(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    # 1e-4, or more where transformers' own fp32 error on these prompts says fp32 cannot do better.
    atol = fp32_atol(ref_logits, exact, floor=1e-4)
    ref_greedy = _hf_greedy(hf, PROMPTS, 32)
    ref_shared = _hf_greedy(hf, SHARED_PROMPTS, 32)

    results = run_local_ranks(_rank_main, 2, d, timeout_s=150)
    for rank, res in enumerate(results):
        assert res["tp_world"] == 2
        assert res["local_heads"] == (2, 1)  # 4 query / 2 KV heads split over 2 ranks
        assert res["kv_pool_heads"] == 1
        assert res["local_vocab_rows"] == 256
        torch.testing.assert_close(torch.tensor(res["prefill_logits"]), ref_logits, atol=atol, rtol=0)
        assert res["greedy"] == ref_greedy, f"rank {rank}"
        assert res["greedy_shared"] == ref_shared, f"rank {rank}"


@pytest.mark.timeout(180)
def test_tp4_replicates_kv_heads(tmp_path):
    """tp 4 > 2 KV heads: each rank holds one (replicated) KV head and the output is unchanged."""
    torch.set_num_threads(1)
    d = str(tmp_path / "qwen3")
    build_tiny_model(d, "qwen3", seed=12, with_tokenizer=False, eos_token_id=None)
    hf = load_hf_model(d)
    with torch.no_grad():
        ref_logits = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        hf64 = float64_copy(hf)
        exact = torch.stack([hf64(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    # 1e-4, or more where transformers' own fp32 error on these prompts says fp32 cannot do better.
    atol = fp32_atol(ref_logits, exact, floor=1e-4)
    ref_greedy = _hf_greedy(hf, PROMPTS, 32)
    results = run_local_ranks(_rank_main, 4, d, timeout_s=150)
    for res in results:
        assert res["local_heads"] == (1, 1)
        torch.testing.assert_close(torch.tensor(res["prefill_logits"]), ref_logits, atol=atol, rtol=0)
        assert res["greedy"] == ref_greedy


def _counted_weight_bytes(model) -> int:
    """Bytes of the tensors the planner's weight estimate counts (it leaves out norms and biases)."""
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if "norm" not in name and not name.endswith(".bias")
    )


def _dp_attention_rank(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    from sglite.srt.model_executor.model_runner import ModelRunner
    from sglite.srt.planner import estimate_weight_bytes_per_rank

    args = ServerArgs(
        model_path=model_dir, device="cpu", tp_size=2, dp_size=2, enable_dp_attention=True, cpu_kv_cache_budget_mb=2
    ).validate()
    runner = ModelRunner(args, rank=rank, world_size=world_size, dist_init_method=init_method)
    layer = runner.model.model.layers[0]
    # Each attention-DP group serves its own requests, and the loads differ: rank 1 finishes early
    # and keeps joining rank 0's MLP / LM-head exchanges with IDLE forwards.
    if rank == 0:
        greedy = greedy_generate(runner, PROMPTS[:3], 32)
    else:
        greedy = greedy_generate(runner, PROMPTS[3:], 12)
        for _ in range(32 - 12):
            assert runner.forward_idle().next_token_logits.shape == (0, runner.model_config.vocab_size)
    return {
        "attn_tp": runner.parallel.attn_tp_size,
        "local_heads": (layer.self_attn.num_heads, layer.self_attn.num_kv_heads),
        "mlp_rows": layer.mlp.gate_up_proj.weight.shape[0],
        "embed_rows": runner.model.model.embed_tokens.weight.shape[0],
        "lm_head_rows": runner.model.lm_head.weight.shape[0],
        "weight_bytes": _counted_weight_bytes(runner.model),
        "estimated_weight_bytes": estimate_weight_bytes_per_rank(runner.model_config, 2, 1),
        "greedy": greedy,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_dp_attention_splits_attention_from_mlp_and_lm_head(arch, tied, tmp_path):
    """tp 2 / dp 2 with DP attention (SGLang's split): attention per group at attn_tp 1, MLP and LM head at tp 2.

    Greedy tokens equal transformers' although the groups run different batches (and one idles), and
    the planner's weight estimate equals the bytes each rank really holds.
    """
    torch.set_num_threads(1)
    d = str(tmp_path / arch)
    build_tiny_model(d, arch, seed=13, with_tokenizer=False, eos_token_id=None, tie_word_embeddings=tied)
    hf = load_hf_model(d)
    ref = _hf_greedy(hf, PROMPTS, 32)
    r0, r1 = run_local_ranks(_dp_attention_rank, 2, d, timeout_s=150)
    cfg = hf.config
    for res in (r0, r1):
        assert res["attn_tp"] == 1
        assert res["local_heads"] == (cfg.num_attention_heads, cfg.num_key_value_heads)  # whole attention
        assert res["mlp_rows"] == cfg.intermediate_size  # (gate + up) / tp 2
        assert res["embed_rows"] == cfg.vocab_size  # embedding split over attn_tp 1
        assert res["lm_head_rows"] == cfg.vocab_size // 2  # LM head over tp 2 (a tied head gets its own copy)
        assert res["weight_bytes"] == res["estimated_weight_bytes"]
    assert r0["greedy"] == ref[:3]
    assert r1["greedy"] == [ref[3][:12]]
