"""KVCacheConfigurator and build_pools: budgets, draft short-circuit, and real CPU tensors == plan.

Configs come from transformers' own config classes (saved to tmp dirs), so the geometry we plan is
the one transformers defines, not one we wrote.
"""

SUITE = "unit-cpu"
EST_TIME = 16

import dataclasses
import json
import pickle

import pytest
import torch
import transformers

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from sglite.srt.model_executor.kv_cache_configurator import (
    MiB,
    KVBudgetInputs,
    KVCacheConfigurator,
    build_pools,
    check_plan_matches_rank,
    compute_device_budget_bytes,
    min_across_group,
)
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import resolve_spec_aux_hidden_state
from sglite.srt.mem_cache.pool_plan import MemoryPlanError
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs


def _save(cfg, path):
    cfg.save_pretrained(path)
    return str(path)


def _tiny_qwen3(tmp_path, name="target", **kw):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                torch_dtype="float32")
    base.update(kw)
    return _save(transformers.Qwen3Config(**base), tmp_path / name)


def _tiny_dflash(tmp_path, num_target_layers=4, kv=2, layers=2):
    p = tmp_path / "draft"
    p.mkdir()
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256, "torch_dtype": "float32", "block_size": 4,
        "max_position_embeddings": 256,
        "dflash_config": {"mask_token_id": 255, "num_target_layers": num_target_layers},
    }
    (p / "config.json").write_text(json.dumps(raw))
    return str(p)


def _configure(sa, *, rank=0):
    mc = ModelConfig.from_path(sa.model_path)
    par = ParallelState(sa.tp_size, sa.dp_size, sa.enable_dp_attention, sa.attn_cp_size)
    with scoped(parallel=par):
        simulate_rank(par, rank)
        aux = resolve_spec_aux_hidden_state(sa, mc)
        cfg = KVCacheConfigurator(sa, mc, aux).configure()
        target = build_pools(cfg, mc, device=sa.resolved_device())
        draft = None
        if aux.has_draft:
            draft = build_pools(cfg, aux.draft_model_config, device=sa.resolved_device(), is_draft=True,
                                target_pools=target)
    return cfg, target, draft


def _check_equal(cfg, target, draft):
    allocated = target.allocated_bytes()
    if draft is not None:
        allocated.update(draft.allocated_bytes())
    planned = {p.name: p.planned_bytes for p in cfg.planned_pools()}
    assert planned == allocated
    assert sum(planned.values()) <= cfg.budget_bytes


@pytest.mark.parametrize("page", [1, 16])
def test_real_cpu_allocation_equals_plan_with_dflash_draft(tmp_path, page):
    sa = ServerArgs(model_path=_tiny_qwen3(tmp_path), device="cpu", cpu_kv_cache_budget_mb=4, page_size=page,
                    speculative_algorithm="DFLASH", speculative_draft_model_path=_tiny_dflash(tmp_path))
    cfg, target, draft = _configure(sa)
    assert cfg.budget_bytes == 4 * MiB
    # target: 2 KV heads x (16 + 16) x 4 layers x 4 B; draft: 2 heads x 32 x 2 layers x 4 B
    assert cfg.target_cell_bytes == 2 * 32 * 4 * 4
    assert cfg.draft_cell_bytes == 2 * 32 * 2 * 4
    _check_equal(cfg, target, draft)
    # Real tensors: sum their bytes directly from torch.
    t = target.token_to_kv_pool
    real = sum(x.numel() * x.element_size() for x in t.k_buffer + t.v_buffer)
    assert real == next(p.planned_bytes for p in cfg.planned_pools() if p.name == "target_kv")
    assert t.k_buffer[0].device.type == "cpu"
    # The draft shares the target's allocator and request table; slot capacity is the target's.
    assert draft.token_to_kv_pool_allocator is target.token_to_kv_pool_allocator
    assert draft.req_to_token_pool is target.req_to_token_pool
    assert draft.token_to_kv_pool.size == cfg.max_total_num_tokens
    assert isinstance(target.token_to_kv_pool_allocator, PagedTokenToKVPoolAllocator)
    assert target.token_to_kv_pool_allocator.available_size() == cfg.max_total_num_tokens
    assert cfg.max_total_num_tokens % page == 0
    assert cfg.planned_total_bytes() >= 0.99 * cfg.budget_bytes


def test_real_cpu_allocation_hybrid_swa(tmp_path):
    cfg_t = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=256, torch_dtype="float32",
    )
    sa = ServerArgs(model_path=_save(cfg_t, tmp_path / "gptoss"), device="cpu", cpu_kv_cache_budget_mb=2, page_size=4)
    cfg, target, _ = _configure(sa)
    assert cfg.configurator == "hybrid_swa" and cfg.swa_max_total_num_tokens < cfg.max_total_num_tokens
    assert isinstance(target.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    _check_equal(cfg, target, None)


def test_real_cpu_allocation_mla(tmp_path):
    cfg_t = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=256, torch_dtype="float32",
    )
    sa = ServerArgs(model_path=_save(cfg_t, tmp_path / "dsv3"), device="cpu", cpu_kv_cache_budget_mb=1)
    cfg, target, _ = _configure(sa)
    assert cfg.target_cell_bytes == (32 + 8) * 2 * 4
    _check_equal(cfg, target, None)


def test_real_cpu_allocation_hybrid_linear(tmp_path):
    cfg_t = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=256, torch_dtype="float32",
    )
    sa = ServerArgs(model_path=_save(cfg_t, tmp_path / "qnext"), device="cpu", cpu_kv_cache_budget_mb=4,
                    max_running_requests=8)
    cfg, target, _ = _configure(sa)
    assert cfg.configurator == "hybrid_linear" and cfg.mamba_state_slots == 8
    _check_equal(cfg, target, None)


def test_max_total_tokens_flag_only_lowers(tmp_path):
    path = _tiny_qwen3(tmp_path)
    full, _, _ = _configure(ServerArgs(model_path=path, device="cpu", cpu_kv_cache_budget_mb=1))
    low, _, _ = _configure(ServerArgs(model_path=path, device="cpu", cpu_kv_cache_budget_mb=1, max_total_tokens=100))
    high, _, _ = _configure(ServerArgs(model_path=path, device="cpu", cpu_kv_cache_budget_mb=1,
                                       max_total_tokens=10 * full.max_total_num_tokens))
    assert low.max_total_num_tokens == 100
    assert high.max_total_num_tokens == full.max_total_num_tokens


def test_memory_pool_config_is_json_friendly(tmp_path):
    sa = ServerArgs(model_path=_tiny_qwen3(tmp_path), device="cpu", cpu_kv_cache_budget_mb=2, page_size=4,
                    speculative_algorithm="DFLASH", speculative_draft_model_path=_tiny_dflash(tmp_path))
    cfg, _, _ = _configure(sa)
    d = json.loads(json.dumps(dataclasses.asdict(cfg)))  # what /get_server_info sends
    assert d["max_total_num_tokens"] == cfg.max_total_num_tokens
    assert d["kv_cache_dtype"] == "float32" and d["draft_kv_cache_dtype"] == "float32"
    assert cfg.kv_cache_torch_dtype is torch.float32 and cfg.draft_kv_cache_torch_dtype is torch.float32
    assert d["planned_pool_bytes"] == {p.name: p.planned_bytes for p in cfg.planned_pools()}
    assert pickle.loads(pickle.dumps(cfg)).plan == cfg.plan  # crosses process boundaries intact


def test_draft_worker_short_circuits(tmp_path):
    sa = ServerArgs(model_path=_tiny_qwen3(tmp_path), device="cpu", cpu_kv_cache_budget_mb=1)
    cfg, _, _ = _configure(sa)
    mc = ModelConfig.from_path(sa.model_path)
    assert KVCacheConfigurator(sa, mc, is_draft=True, target_memory_pool_config=cfg).configure() is cfg
    with pytest.raises(MemoryPlanError, match="never sizes itself"):
        KVCacheConfigurator(sa, mc, is_draft=True).configure()


def test_cuda_budget_formula_and_min_over_group(tmp_path):
    assert compute_device_budget_bytes(100 * MiB, 30 * MiB, 0.9) == 60 * MiB
    sa = ServerArgs(model_path=_tiny_qwen3(tmp_path), device="cuda", mem_fraction_static=0.5)
    mc = ModelConfig.from_path(sa.model_path)
    conf = KVCacheConfigurator(sa, mc)

    class FakeGroup:  # what GroupCoordinator.all_gather_object returns on a 3-rank group
        def all_gather_object(self, obj):
            return [obj, obj - 5 * MiB, obj + 7 * MiB]

    assert conf.resolve_budget_bytes(KVBudgetInputs(pre_model_load_free_bytes=40 * MiB, weights_bytes=4 * MiB)) == 16 * MiB
    assert conf.resolve_budget_bytes(KVBudgetInputs(pre_model_load_free_bytes=40 * MiB, post_model_load_free_bytes=36 * MiB)) == 16 * MiB
    assert conf.resolve_budget_bytes(KVBudgetInputs(pre_model_load_free_bytes=40 * MiB, weights_bytes=4 * MiB,
                                                    tp_group=FakeGroup())) == 11 * MiB
    assert min_across_group(5, None) == 5
    with pytest.raises(MemoryPlanError, match="pre_model_load_free_bytes"):
        conf.resolve_budget_bytes()
    with pytest.raises(MemoryPlanError, match="mem-fraction-static"):
        conf.resolve_budget_bytes(KVBudgetInputs(pre_model_load_free_bytes=10 * MiB, weights_bytes=9 * MiB))


def test_a_plan_built_at_another_width_is_refused(tmp_path):
    sa = ServerArgs(model_path=_tiny_qwen3(tmp_path), device="cpu", cpu_kv_cache_budget_mb=1, tp_size=2)
    cfg, _, _ = _configure(sa)
    par = ParallelState(2, 2, True)  # attn_tp 1, but the plan was made at attn_tp 2
    with scoped(parallel=par):
        simulate_rank(par, 0)
        with pytest.raises(MemoryPlanError, match="attn_tp_size"):
            check_plan_matches_rank(cfg)


def test_pd_decode_node_adds_request_rows(tmp_path):
    path = _tiny_qwen3(tmp_path)
    plain, t_plain, _ = _configure(ServerArgs(model_path=path, device="cpu", cpu_kv_cache_budget_mb=1,
                                              max_running_requests=8))
    dec, t_dec, _ = _configure(ServerArgs(model_path=path, device="cpu", cpu_kv_cache_budget_mb=1,
                                          max_running_requests=8, disaggregation_mode="decode",
                                          disaggregation_decode_extra_slots=5))
    assert plain.max_running_requests == dec.max_running_requests == 8
    assert t_plain.req_to_token_pool.size == 8 and t_dec.req_to_token_pool.size == 13
    _check_equal(dec, t_dec, None)


@pytest.fixture
def pair(tmp_path):
    return _tiny_qwen3(tmp_path), _tiny_dflash(tmp_path)


def _deferred_args(pair, **kw):
    base = dict(model_path=pair[0], device="cpu", cpu_kv_cache_budget_mb=4, max_running_requests=8,
                speculative_algorithm="DFLASH", speculative_draft_model_path=pair[1])
    base.update(kw)
    return ServerArgs(**base).validate()


@pytest.mark.parametrize("flag", [dict(speculative_adaptive=True), dict(speculative_disable_by_batch_size=4)])
def test_draft_free_steps_plan_the_deferred_context_buffer_and_it_costs_kv_tokens(pair, flag):
    off, t_off, d_off = _configure(_deferred_args(pair))
    on, t_on, d_on = _configure(_deferred_args(pair, **flag))
    assert "draft_deferred_context" not in off.planned_pool_bytes and d_off.deferred_context is None
    # 256 rows of the features the 2-layer draft reads (2 captured target layers x hidden 64, fp32), plus an
    # int64 position and slot each
    width = 2 * 64
    deferred = 256 * (width * 4 + 8 + 8)
    assert on.planned_pool_bytes["draft_deferred_context"] == deferred == d_on.deferred_context.nbytes()
    assert d_on.deferred_context.features.shape == (256, width)
    _check_equal(on, t_on, d_on)
    # The buffer comes out of the KV budget: the flag costs exactly the tokens whose bytes, beyond the slack
    # the plan without it left, make room for it (page 1, fixed request rows).
    cell = off.target_cell_bytes + off.draft_cell_bytes
    slack = off.budget_bytes - off.planned_total_bytes()
    assert 0 <= slack < cell
    assert on.max_total_num_tokens == off.max_total_num_tokens - -(-(deferred - slack) // cell)
    assert on.planned_total_bytes() <= on.budget_bytes


def test_deferred_context_buffer_is_the_same_on_every_tp_rank(pair):
    one, _, _ = _configure(_deferred_args(pair, speculative_disable_by_batch_size=4))
    for rank in (0, 1):
        cfg, target, draft = _configure(_deferred_args(pair, speculative_disable_by_batch_size=4, tp_size=2),
                                        rank=rank)
        # Every rank holds the full hidden width of the captured features (TP all-reduces them).
        assert cfg.planned_pool_bytes["draft_deferred_context"] == one.planned_pool_bytes["draft_deferred_context"]
        _check_equal(cfg, target, draft)


def test_a_pd_prefill_node_never_defers(pair):
    cfg, _, draft = _configure(_deferred_args(pair, speculative_disable_by_batch_size=4,
                                              disaggregation_mode="prefill"))
    assert "draft_deferred_context" not in cfg.planned_pool_bytes and draft.deferred_context is None
