"""GPU suite: on CUDA the budget comes from the memory profile and the real pools take exactly the plan."""

SUITE = "gpu"
EST_TIME = 30

import os

import pytest
import torch

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.model_executor.kv_cache_configurator import (
    GiB,
    KVBudgetInputs,
    KVCacheConfigurator,
    build_pools,
    get_free_device_memory,
)
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import resolve_spec_aux_hidden_state
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# The repo's copies of shared/model_configs (identical files), so a fresh clone anywhere finds them.
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "model_configs")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_cuda_pools_take_exactly_the_plan(kv_dtype):
    target = ModelConfig.from_path(os.path.join(CONFIGS, "qwen3-8b.json"))
    draft = ModelConfig.from_path(os.path.join(CONFIGS, "qwen3-8b-dflash-b16.json"))
    sa = ServerArgs(model_path="unused", device="cuda", kv_cache_dtype=kv_dtype, page_size=16,
                    mem_fraction_static=0.5, speculative_algorithm="DFLASH", speculative_draft_model_path="unused",
                    context_length=4096, max_running_requests=64)
    par = ParallelState(16, 16, True)
    torch.cuda.empty_cache()
    free = get_free_device_memory("cuda")
    # Pretend 1 GiB of weights and cap the pools at a few GiB so the test leaves the device usable.
    with scoped(parallel=par):
        simulate_rank(par, 0)
        aux = resolve_spec_aux_hidden_state(sa, target, draft_model_config=draft)
        conf = KVCacheConfigurator(sa, target, aux)
        budget = conf.resolve_budget_bytes(KVBudgetInputs(pre_model_load_free_bytes=min(free, 8 * GiB), weights_bytes=1 * GiB))
        assert budget == int(min(free, 8 * GiB) * 0.5) - GiB
        cfg = conf.configure(KVBudgetInputs(budget_bytes=budget))
        before = torch.cuda.memory_allocated()
        t = build_pools(cfg, target, device="cuda")
        d = build_pools(cfg, draft, device="cuda", is_draft=True, target_pools=t)
        used = torch.cuda.memory_allocated() - before
    planned = {p.name: p.planned_bytes for p in cfg.planned_pools()}
    allocated = {**t.allocated_bytes(), **d.allocated_bytes()}
    assert planned == allocated
    # The caching allocator rounds each block up to 512 B; pools are far larger than that.
    assert abs(used - sum(planned.values())) <= 512 * (len(t.token_to_kv_pool.k_buffer) * 2 + 16)
    assert sum(planned.values()) <= budget
    assert t.token_to_kv_pool.get_key_buffer(0).is_cuda
    loc = t.token_to_kv_pool_allocator.alloc(20)
    k = torch.randn(20, 8, 128, device="cuda")
    d.token_to_kv_pool.set_kv_buffer(3, loc, k, k)
    got = d.token_to_kv_pool.get_key_buffer(3)[loc].float()
    assert torch.allclose(got, k.to(aux.draft_kv_cache_dtype).float())
    del t, d
    torch.cuda.empty_cache()
