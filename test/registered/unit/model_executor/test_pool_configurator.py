"""Pool configurators: cell sizes, budget solve, page alignment, draft terms for every layout.

Reference numbers come from the issue and SGLang's PR #34234 table (target 32 layers, 4 KV heads,
hd = vhd = 128, bf16, 5-layer draft: target cell 65536 B; layer-ratio total 75776 B; exact draft
10240 / 20480 / 5120 B for 4 / 8 / 2 draft KV heads).
"""

SUITE = "unit-cpu"
EST_TIME = 8

import dataclasses
import os

import pytest
import torch

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.mem_cache.pool_plan import MemoryPlanError
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
    SpecAuxHiddenStateConfig,
    resolve_spec_aux_hidden_state,
)
from sglite.srt.model_executor.pool_configurator import (
    ConfiguratorInputs,
    DefaultPoolConfigurator,
    HybridLinearPoolConfigurator,
    HybridSWAPoolConfigurator,
    create_pool_configurator,
)
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs

# The repo's copies of shared/model_configs (identical files), so a fresh clone anywhere finds them.
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "model_configs")
GiB = 1 << 30


def _mc(name):
    return ModelConfig.from_path(os.path.join(CONFIGS, name))


def _gqa(layers=32, kv=4, hd=128, dtype="bfloat16"):
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32 * hd,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": 1000, "torch_dtype": dtype, "max_position_embeddings": 8192,
    })


def _draft(kv=8, layers=5, target_layers=32):
    return ModelConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": kv, "head_dim": 128,
        "vocab_size": 1000, "torch_dtype": "bfloat16", "block_size": 16,
        "dflash_config": {"num_target_layers": target_layers, "mask_token_id": 0},
    })


class _Topology:
    def __init__(self, tp=1, dp=1, dpa=False, cp=1, rank=0):
        self.par = ParallelState(tp, dp, dpa, cp)
        self.rank = rank

    def __enter__(self):
        self._cm = scoped(parallel=self.par)
        self._cm.__enter__()
        simulate_rank(self.par, self.rank)
        return self.par

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _inputs(mc, aux=None, page=1, dtype=torch.bfloat16, ctx=8192, **kw):
    return ConfiguratorInputs(
        model_config=mc, kv_cache_dtype=dtype, model_dtype=torch.bfloat16, page_size=page, context_len=ctx,
        spec_aux=aux or SpecAuxHiddenStateConfig(), **kw,
    )


def _aux(algo, mc, draft, **args):
    sa = ServerArgs(speculative_algorithm=algo, speculative_draft_model_path="x", **args)
    return resolve_spec_aux_hidden_state(sa, mc, draft_model_config=draft)


def _eagle_draft(mc, layers=1):
    raw = dict(mc.hf_config, num_hidden_layers=layers)
    raw.pop("layer_types", None)
    if mc.is_hybrid_swa or mc.is_hybrid_linear:
        raise AssertionError("use a uniform target here")
    return ModelConfig.from_dict(raw)


# ---------------------------------------------------------------- cell sizes


def test_pr34234_table():
    mc = _gqa()
    with _Topology():
        assert DefaultPoolConfigurator(_inputs(mc)).target_cell_bytes() == 65536
        for heads, draft_bytes in ((4, 10240), (8, 20480), (2, 5120)):
            conf = DefaultPoolConfigurator(_inputs(mc, _aux("DFLASH", mc, _draft(kv=heads))))
            assert conf.draft_cell_bytes() == draft_bytes
            assert conf.cell_bytes() == 65536 + draft_bytes
        eagle = _eagle_draft(mc, layers=5)
        conf = DefaultPoolConfigurator(_inputs(mc, _aux("EAGLE", mc, eagle)))
        assert conf.cell_bytes() == 75776  # ceil(65536 * (32 + 5) / 32)


def test_mla_cell_is_not_sharded():
    mc = _mc("deepseek-v3.json")
    for tp in (1, 8, 16):
        with _Topology(tp=tp):
            assert DefaultPoolConfigurator(_inputs(mc)).target_cell_bytes() == (512 + 64) * 61 * 2


def test_gqa_heads_replicate_past_their_count():
    mc = _gqa(kv=8)
    for tp, heads in ((1, 8), (4, 2), (8, 1), (16, 1)):
        with _Topology(tp=tp):
            assert DefaultPoolConfigurator(_inputs(mc)).target_cell_bytes() == heads * 256 * 32 * 2


# ---------------------------------------------------------------- budget solve


@pytest.mark.parametrize("page", [1, 16, 64, 128])
def test_default_solve_uses_the_budget(page):
    mc = _gqa()
    with _Topology():
        conf = DefaultPoolConfigurator(_inputs(mc, _aux("DFLASH", mc, _draft()), page=page))
        budget = 10 * GiB
        plan = conf.solve(budget)
        assert plan.max_total_num_tokens % page == 0
        total = plan.total_bytes()
        assert total <= budget
        # one more page would not fit
        assert conf.plan_for_tokens(plan.max_total_num_tokens + page).total_bytes() > budget
        assert total >= 0.99 * budget
        assert plan.max_total_num_tokens * conf.cell_bytes() <= budget


def test_max_total_tokens_only_lowers():
    mc = _gqa()
    with _Topology():
        conf = DefaultPoolConfigurator(_inputs(mc, page=128))
        assert conf.solve(10 * GiB, max_total_tokens=1000).max_total_num_tokens == 896
        free = conf.solve(10 * GiB).max_total_num_tokens
        assert conf.solve(10 * GiB, max_total_tokens=10 * free).max_total_num_tokens == free


def test_too_small_budget_is_a_clear_error():
    mc = _gqa()
    with _Topology():
        with pytest.raises(MemoryPlanError, match="not enough memory"):
            DefaultPoolConfigurator(_inputs(mc, page=64)).solve(1 << 20)


def test_max_running_requests_rule():
    mc = _gqa()
    with _Topology(tp=4, dp=4, dpa=True):
        conf = DefaultPoolConfigurator(_inputs(mc, max_running_requests=64))
        assert conf.max_running_requests_for(10**6) == 16  # split over 4 attention-DP ranks
        assert conf.max_running_requests_for(20) == 10  # never more than half the tokens
    with _Topology():
        conf = DefaultPoolConfigurator(_inputs(mc, ctx=8192))
        assert conf.max_running_requests_for(10**6) == 4096
        assert conf.max_running_requests_for(8192 * 5) == 2560  # 5 contexts * 512
        assert conf.max_running_requests_for(8192 * 2) == 2048  # clamped up to 2048


# ---------------------------------------------------------------- hybrid SWA


def test_hybrid_swa_pool_sizes_and_draft():
    mc = _mc("gpt-oss-120b.json")
    with _Topology(tp=8):
        aux = _aux("DFLASH", mc, _draft(target_layers=36))
        conf = create_pool_configurator(_inputs(mc, aux, page=64, swa_full_tokens_ratio=0.5))
        assert isinstance(conf, HybridSWAPoolConfigurator)
        assert conf.draft_cell_bytes() == 1 * 256 * 5 * 2  # 8 draft heads / attn_tp 8
        plan = conf.solve(20 * GiB)
        T = plan.max_total_num_tokens
        assert T % 64 == 0 and plan.swa_max_total_num_tokens % 64 == 0
        assert plan.swa_max_total_num_tokens == int(T * 0.5) // 64 * 64
        assert plan.draft is not None and {p.name for p in plan.planned_pools()} >= {"draft_kv", "target_kv_swa"}
        assert 0.99 * 20 * GiB <= plan.total_bytes() <= 20 * GiB


def test_hybrid_swa_window_must_fit():
    mc = _mc("gemma-3-27b-it.json")  # window 1024
    with _Topology():
        conf = create_pool_configurator(_inputs(mc, swa_full_tokens_ratio=0.05))
        with pytest.raises(MemoryPlanError, match="window"):
            conf.solve(1 * GiB)


# ---------------------------------------------------------------- hybrid linear


def test_hybrid_linear_state_and_kv():
    mc = _mc("qwen3-next-80b-a3b-instruct.json")
    with _Topology(tp=4):
        conf = create_pool_configurator(_inputs(mc, max_running_requests=32))
        assert isinstance(conf, HybridLinearPoolConfigurator)
        # only the 12 full-attention layers hold KV: 2 KV heads / attn_tp 4 -> 1 head, hd 256
        assert conf.target_cell_bytes() == 1 * 512 * 12 * 2
        st = conf.target_state
        assert len(st.layer_ids) == 36 and st.num_heads == 32 // 4
        plan = conf.solve(8 * GiB)
        assert plan.state_slots == 32 and plan.max_running_requests == 32
        assert plan.total_bytes() <= 8 * GiB and plan.total_bytes() >= 0.99 * 8 * GiB


def test_hybrid_linear_prices_a_draft():
    mc = _mc("kimi-linear-48b-a3b-instruct.json")
    with _Topology(tp=2):
        aux = _aux("DFLASH", mc, _draft(target_layers=27))
        conf = create_pool_configurator(_inputs(mc, aux))
        assert conf.target_attn.kind == "mla"
        assert conf.draft_cell_bytes() == 4 * 256 * 5 * 2
        plan = conf.solve(30 * GiB)
        assert plan.total_bytes() <= 30 * GiB


# ---------------------------------------------------------------- no silent zero


def test_dflash_draft_without_a_price_is_refused():
    mc = _gqa()
    with _Topology():
        aux = _aux("DFLASH", mc, _draft())
        broken = dataclasses.replace(aux, draft_geometry=None)
        with pytest.raises(MemoryPlanError, match="zero bytes"):
            DefaultPoolConfigurator(_inputs(mc, broken))


def test_draft_priced_at_another_width_is_refused():
    mc = _gqa()
    with _Topology(tp=16, dp=16, dpa=True):
        aux = _aux("DFLASH", mc, _draft())
    with _Topology(tp=16):
        with pytest.raises(MemoryPlanError, match="attn_tp_size"):
            DefaultPoolConfigurator(_inputs(mc, aux))


def test_eagle_layer_ratio_must_equal_the_drafts_own_price():
    """The ratio price (target per-layer cell x draft layers) is checked against the draft's own geometry."""
    mc = _gqa()
    with _Topology():
        aux = _aux("EAGLE", mc, _eagle_draft(mc, layers=5))
        conf = DefaultPoolConfigurator(_inputs(mc, aux))
        assert conf.draft_cell_bytes() == aux.draft_cell_bytes == conf.draft.cell_bytes() == 65536 * 5 // 32
        assert conf.draft_pricing == "layer_ratio"
        # A draft whose own heads differ from the target's (the resolver refuses such a config.json too).
        wider = dataclasses.replace(aux, draft_geometry=dataclasses.replace(aux.draft_geometry, head_num=8))
        with pytest.raises(MemoryPlanError, match="layer-ratio"):
            DefaultPoolConfigurator(_inputs(mc, wider))


def test_dflash_draft_price_is_the_draft_pools_bytes_per_token():
    """One owner: the resolver's price == the configurator's == the built draft pool's bytes per token."""
    mc = _gqa()
    with _Topology():
        aux = _aux("DFLASH", mc, _draft(kv=8))
        conf = DefaultPoolConfigurator(_inputs(mc, aux))
        plan = conf.plan_for_tokens(64)
        pool = plan.build_draft_kv_pool("meta")
        assert aux.draft_cell_bytes == conf.draft_cell_bytes() == plan.draft.cell_bytes() == 20480
        assert conf.draft_pricing == "draft_geometry"
        assert pool.nbytes() == (64 + plan.page_size) * aux.draft_cell_bytes


def test_eagle_with_other_kv_dtype_is_refused():
    mc = _gqa()
    with _Topology():
        aux = _aux("EAGLE", mc, _eagle_draft(mc), speculative_draft_kv_cache_dtype="fp8_e4m3")
        with pytest.raises(MemoryPlanError, match="dtype"):
            DefaultPoolConfigurator(_inputs(mc, aux))


# ---------------------------------------------------------------- property: any geometry, any topology
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sglite.srt.model_executor.kv_cache_configurator import KVPools  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(4, 64),  # the DFlash capture rule needs >= 4 target layers
    kv=st.sampled_from([1, 2, 4, 8, 16, 32]),
    hd=st.sampled_from([64, 128, 256]),
    draft_kv=st.sampled_from([1, 2, 4, 8, 16]),
    draft_layers=st.integers(1, 8),
    topo=st.sampled_from([(1, 1, False, 1), (8, 1, False, 1), (16, 16, True, 1), (16, 4, True, 2), (4, 2, True, 1)]),
    page=st.sampled_from([1, 16, 64]),
    kv_dtype=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn, torch.float32]),
    budget_mib=st.integers(64, 100 * 1024),
    ctx=st.sampled_from([512, 4096, 32768]),
    draft_free=st.booleans(),
)
def test_property_plan_fits_fills_and_builds_exactly(layers, kv, hd, draft_kv, draft_layers, topo, page, kv_dtype,
                                                     budget_mib, ctx, draft_free):
    tp, dp, dpa, cp = topo
    mc = _gqa(layers=layers, kv=kv, hd=hd)
    draft = _draft(kv=draft_kv, layers=draft_layers, target_layers=layers)
    budget = budget_mib << 20
    with _Topology(tp=tp, dp=dp, dpa=dpa, cp=cp, rank=tp - 1) as par:
        aux = _aux("DFLASH", mc, draft)
        conf = DefaultPoolConfigurator(_inputs(mc, aux, page=page, dtype=kv_dtype, ctx=ctx, draft_free_steps=draft_free))
        w = par.attn_tp_size
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        assert conf.draft_cell_bytes() == max(1, draft_kv // w) * 256 * draft_layers * 2  # draft dtype: bf16
        assert conf.target_cell_bytes() == max(1, kv // w) * 2 * hd * layers * elem
        try:
            plan = conf.solve(budget)
        except MemoryPlanError:
            # Only a budget below one page (plus the request table) may be refused.
            assert budget < conf.plan_for_tokens(2 * page).total_bytes()
            return
        total = plan.total_bytes()
        assert total <= budget and plan.max_total_num_tokens % page == 0
        assert conf.plan_for_tokens(plan.max_total_num_tokens + page).total_bytes() > budget
        built = KVPools(plan.build_target_kv_pool("meta"), plan.build_req_to_token_pool("meta")).allocated_bytes()
        built["draft_kv"] = plan.build_draft_kv_pool("meta").nbytes()
        deferred = plan.build_draft_deferred_context("meta")
        if draft_free:  # draft-free steps' rows: the draft's captured target layers x hidden, bf16 (model dtype)
            built["draft_deferred_context"] = deferred.nbytes()
            assert deferred.nbytes() == 256 * (draft_layers * 32 * hd * 2 + 16)
        else:
            assert deferred is None
        assert built == {p.name: p.planned_bytes for p in plan.planned_pools()}
