"""MoE routing equals transformers' routers; the expert computation equals a per-token loop; TP and EP
shards loaded from full checkpoint tensors sum back to the unsharded layer."""

import pytest
import torch
import torch.nn.functional as F

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.moe.fused_moe_native import fused_moe_native
from sglite.srt.layers.moe.layer import FusedMoE, expert_params_mapping
from sglite.srt.layers.moe.topk import TopKConfig, select_experts
from sglite.testing.tiny_models import tiny_config

SUITE = "unit-cpu"
EST_TIME = 5

E, H, I, T = 8, 16, 12, 11


def _group(size: int, rank: int) -> GroupCoordinator:
    return GroupCoordinator(list(range(size)), rank, "tp", device_group=None if size == 1 else object())


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_equals_qwen3_moe_router(renormalize):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = tiny_config("qwen3_moe", hidden_size=H, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.manual_seed(0)
    router.weight.data.normal_()
    x = torch.randn(T, H)
    _, ref_w, ref_ids = router(x)
    w, ids = select_experts(F.linear(x, router.weight), TopKConfig(top_k=cfg.num_experts_per_tok, renormalize=renormalize))
    rw, rids = _sorted(ref_w, ref_ids)
    gw, gids = _sorted(w, ids)
    assert torch.equal(gids, rids)
    torch.testing.assert_close(gw, rw.float(), rtol=0, atol=1e-6)


def test_grouped_sigmoid_topk_equals_deepseek_v3_router():
    """Correction bias only chooses; groups are scored by their two best experts; weights scaled."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tiny_config("deepseek_v3", hidden_size=H, n_group=4, topk_group=2, num_experts_per_tok=3)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(1)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(T, H)
    _, ref_w, ref_ids = router(x)
    topk = TopKConfig(top_k=3, scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                      routed_scaling_factor=cfg.routed_scaling_factor)
    w, ids = select_experts(F.linear(x, router.weight), topk, router.e_score_correction_bias)
    rw, rids = _sorted(ref_w, ref_ids)
    gw, gids = _sorted(w, ids)
    assert torch.equal(gids, rids)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-6)
    # The bias changes which experts are chosen, so a bias-free router would differ on these inputs.
    _, no_bias_ids = select_experts(F.linear(x, router.weight), topk)
    assert not torch.equal(_sorted(w, no_bias_ids)[1], gids)


def test_topk_config_refuses_bad_routing():
    with pytest.raises(ValueError, match="scoring_func"):
        TopKConfig(top_k=2, scoring_func="relu")
    with pytest.raises(ValueError, match="n_group and topk_group"):
        TopKConfig(top_k=2, num_expert_group=4)
    with pytest.raises(ValueError, match="equal groups"):
        select_experts(torch.randn(2, 6), TopKConfig(top_k=1, num_expert_group=4, topk_group=1))


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=g)
    up = torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    return gate, up, down


def _per_token_reference(x, gate, up, down, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            out[t] += w * (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])) @ down[e].T
    return out


def test_native_experts_equal_per_token_loop_and_split_by_expert():
    gate, up, down = _experts()
    torch.manual_seed(2)
    x = torch.randn(T, H)
    weights, ids = select_experts(torch.randn(T, E), TopKConfig(top_k=2))
    ref = _per_token_reference(x, gate, up, down, weights, ids)
    w13 = torch.cat([gate, up], dim=1)
    torch.testing.assert_close(fused_moe_native(x, w13, down, weights, ids), ref, rtol=1e-5, atol=1e-4)
    # Two expert-parallel halves: each computes only its experts, the sum is the whole layer.
    lo = fused_moe_native(x, w13[:4], down[:4], weights, ids, first_local_expert=0)
    hi = fused_moe_native(x, w13[4:], down[4:], weights, ids, first_local_expert=4)
    torch.testing.assert_close(lo + hi, ref, rtol=1e-5, atol=1e-4)
    assert fused_moe_native(x[:0], w13, down, weights[:0], ids[:0]).shape == (0, H)


@pytest.mark.parametrize("tp_size,ep_size", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_fused_moe_shards_sum_to_the_whole_layer(tp_size, ep_size):
    """Each rank loads its slice from the per-expert checkpoint tensors; partial outputs sum to the full layer."""
    gate, up, down = _experts(3)
    torch.manual_seed(4)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    topk = TopKConfig(top_k=2)
    mapping = expert_params_mapping(E)
    total = torch.zeros(T, H)
    for rank in range(tp_size):
        layer = FusedMoE(E, H, I * 2 if tp_size == 4 else I, topk, _group(tp_size, rank), ep_size=ep_size,
                         reduce_results=False)
        params = dict(layer.named_parameters())
        inter = layer.intermediate_size
        full = {"gate_proj": torch.cat([gate, gate], 1)[:, :inter], "up_proj": torch.cat([up, up], 1)[:, :inter],
                "down_proj": torch.cat([down, down], 2)[:, :, :inter]}
        for ckpt, param, shard in mapping:
            expert, proj = shard[0], ckpt.split(".")[3]
            p = params[param.lstrip(".").split(".", 1)[1]]
            p.weight_loader(p, full[proj][expert], shard)
        assert layer.num_local_experts == E // ep_size
        total += layer(x, logits)
    whole = FusedMoE(E, H, I * 2 if tp_size == 4 else I, topk, _group(1, 0))
    whole.w13_weight.data.copy_(torch.cat([torch.cat([gate, gate], 1)[:, : whole.intermediate_size],
                                           torch.cat([up, up], 1)[:, : whole.intermediate_size]], 1))
    whole.w2_weight.data.copy_(torch.cat([down, down], 2)[:, :, : whole.intermediate_size])
    torch.testing.assert_close(total, whole(x, logits), rtol=1e-5, atol=1e-4)


def test_fused_moe_refuses_bad_shapes_and_widths():
    with pytest.raises(ValueError, match="--ep-size 3"):
        FusedMoE(E, H, I, TopKConfig(top_k=2), _group(2, 0), ep_size=3)
    layer = FusedMoE(E, H, I, TopKConfig(top_k=2), _group(1, 0))
    with pytest.raises(ValueError, match="expert 0 down_proj"):
        layer.weight_loader(layer.w2_weight, torch.zeros(H, I + 1), (0, "w2"))
    with pytest.raises(ValueError, match="outside the model's 8 experts"):
        layer.weight_loader(layer.w2_weight, torch.zeros(H, I), (8, "w2"))


@pytest.mark.parametrize("first_local,num_local", [(0, E), (4, 4)])
def test_triton_experts_equal_native(first_local, num_local):
    """The Triton grouped GEMMs (interpreter on CPU) equal the torch-native experts, EP halves included."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1 (set by test/conftest.py on CPU hosts)")
    from sglite.srt.layers.moe.fused_moe_triton import align_pairs, fused_moe_triton

    gate, up, down = _experts(5)
    torch.manual_seed(6)
    x = torch.randn(37, H)  # 37 * 2 pairs: several blocks per expert, ragged tails
    weights, ids = select_experts(torch.randn(37, E), TopKConfig(top_k=2))
    w13 = torch.cat([gate, up], dim=1)[first_local : first_local + num_local]
    w2 = down[first_local : first_local + num_local]
    ref = fused_moe_native(x, w13, w2, weights, ids, first_local_expert=first_local)
    got = fused_moe_triton(x, w13, w2, weights, ids, first_local_expert=first_local)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    pairs, experts = align_pairs(ids, num_local, first_local)
    assert pairs.numel() % 16 == 0 and experts.numel() == pairs.numel() // 16
    local = ((ids >= first_local) & (ids < first_local + num_local)).sum()
    assert int((pairs < ids.numel()).sum()) == int(local)  # each local pair once, the rest is padding
