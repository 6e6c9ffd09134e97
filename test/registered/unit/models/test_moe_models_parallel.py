"""MoE families over two gloo ranks: TP, expert parallelism and DP attention give transformers' greedy tokens,
and each rank holds exactly the weight bytes the planner estimates and the KV bytes the plan prices.

DP attention splits the groups' work unevenly (one group idles while the other decodes), which the
MoE layer's single all-reduce must survive like a dense MLP's.
"""

import pytest
import torch

from sglite.srt.distributed.local_launch import run_local_ranks
from sglite.srt.server_args import ServerArgs
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.runner_generate import greedy_generate
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 90

PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42]]
NEW_TOKENS = 16

TOPOLOGIES = {
    "tp2": dict(tp_size=2),
    "tp2_ep2": dict(tp_size=2, ep_size=2),
    "tp2_dp2_dp_attention": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
}


def _rank_main(rank: int, world_size: int, init_method: str, model_dir: str, topology: dict) -> dict:
    from sglite.srt.model_executor.model_runner import ModelRunner
    from sglite.srt.planner import estimate_weight_bytes_per_rank

    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=2, **topology).validate()
    runner = ModelRunner(args, rank=rank, world_size=world_size, dist_init_method=init_method)
    experts = next(m for m in runner.model.modules() if type(m).__name__ == "FusedMoE")
    if topology.get("enable_dp_attention"):
        # Each attention-DP group serves its own requests; rank 1 finishes first and joins the MoE
        # all-reduces and LM-head exchanges with IDLE forwards.
        greedy = greedy_generate(runner, PROMPTS[:3] if rank == 0 else PROMPTS[3:], NEW_TOKENS if rank == 0 else 6)
        if rank == 1:
            for _ in range(NEW_TOKENS - 6):
                runner.forward_idle()
    else:
        greedy = greedy_generate(runner, PROMPTS, NEW_TOKENS)
    counted = sum(
        p.numel() * p.element_size()
        for name, p in runner.model.named_parameters()
        if "norm" not in name and not name.endswith(".bias") and "e_score_correction_bias" not in name
    )
    pools = runner.kv_pools.allocated_bytes()
    planned = {p.name: p.planned_bytes for p in runner.memory_pool_config.planned_pools()}
    return {
        "greedy": greedy,
        "local_experts": (experts.first_local_expert, experts.num_local_experts),
        "expert_width": experts.intermediate_per_partition,
        "attn_tp": runner.parallel.attn_tp_size,
        "weight_bytes": counted,
        "estimated_weight_bytes": estimate_weight_bytes_per_rank(
            runner.model_config, runner.parallel.tp_size, runner.parallel.attn_tp_size
        ),
        "allocated": {k: v for k, v in pools.items() if k in planned},
        "planned": {k: v for k, v in planned.items() if k in pools},
    }


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def family(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    build_tiny_model(d, request.param, seed=21, with_tokenizer=False, eos_token_id=None, num_hidden_layers=2)
    hf = load_hf_model(d)
    expected = [
        hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
        for p in PROMPTS
    ]
    assert_clear_greedy_margins(hf, PROMPTS, expected)
    return request.param, d, expected, hf.config


@pytest.mark.timeout(240)
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_two_ranks_match_transformers(family, topology):
    torch.set_num_threads(1)
    arch, d, expected, cfg = family
    results = run_local_ranks(_rank_main, 2, d, TOPOLOGIES[topology], timeout_s=200)
    ep = TOPOLOGIES[topology].get("ep_size", 1)
    num_experts = cfg.num_local_experts
    for rank, res in enumerate(results):
        if topology.startswith("tp2_dp2"):
            assert res["attn_tp"] == 1
            assert res["greedy"] == (expected[:3] if rank == 0 else [expected[3][:6]])
        else:
            assert res["greedy"] == expected, f"rank {rank}"
        assert res["local_experts"] == ((num_experts // ep) * (rank if ep == 2 else 0), num_experts // ep)
        assert res["expert_width"] == cfg.moe_intermediate_size // (2 // ep)
        assert res["weight_bytes"] == res["estimated_weight_bytes"]
        assert res["allocated"] == res["planned"] and res["allocated"]
