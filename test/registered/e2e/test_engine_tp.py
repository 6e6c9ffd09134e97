"""sglite.Engine with --tp-size 2 on CPU (two gloo scheduler ranks): greedy equals transformers, and the
launcher reports one memory plan per rank."""

import os

import pytest
import torch

from conftest import CHILD_ENV

SUITE = "e2e-cpu"
EST_TIME = 65

pytestmark = pytest.mark.timeout(300)
EOS = 2


def test_tp2_engine_greedy_equals_transformers(tmp_path):
    import sglite
    from sglite.testing.tiny_models import build_tiny_model, load_hf_model

    torch.set_num_threads(1)
    model = build_tiny_model(str(tmp_path / "m"), "qwen3")
    hf = load_hf_model(model)
    prompts = [[11, 12, 13], [40, 41]]
    with torch.no_grad():
        refs = []
        for p in prompts:
            g = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)[0, len(p):].tolist()
            refs.append(g[: g.index(EOS) + 1] if EOS in g else g)
    os.environ.update(CHILD_ENV)
    engine = sglite.Engine(model_path=model, device="cpu", cpu_kv_cache_budget_mb=4, tp_size=2)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert [o["output_ids"] for o in outs] == refs
        info = engine.get_server_info()
        assert set(info["process_pids"]) == {"scheduler rank 0", "scheduler rank 1", "detokenizer"}
        plans = info["memory_plan_per_rank"]
        assert len(plans) == 2 and plans[0]["max_total_num_tokens"] == plans[1]["max_total_num_tokens"]
        assert plans[0]["attn_tp_size"] == 2
    finally:
        engine.shutdown()
