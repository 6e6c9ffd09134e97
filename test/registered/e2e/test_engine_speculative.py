"""sglite.Engine with a DFLASH draft at --tp-size 2 (two gloo scheduler ranks): greedy output equals
transformers' greedy output of the target, the speculation meta (spec_verify_ct, spec_accept_length,
avg_spec_accept_length) is reported, and the launcher reports one memory plan per rank.
(One engine covers both the multi-rank launcher and speculation: engine start-up dominates on 2 cores.)"""

import os

import pytest
import torch

from conftest import CHILD_ENV
from sglite.testing.greedy_margin import assert_clear_greedy_margins

SUITE = "e2e-cpu"
EST_TIME = 90

pytestmark = pytest.mark.timeout(300)
EOS = 2


def test_dflash_tp2_engine_greedy_and_meta(tmp_path):
    import sglite
    from sglite.testing.tiny_dflash import build_tiny_dflash_draft
    from sglite.testing.tiny_models import build_tiny_model, load_hf_model

    torch.set_num_threads(1)
    target = build_tiny_model(str(tmp_path / "target"), "qwen3", num_hidden_layers=4)
    draft = build_tiny_dflash_draft(str(tmp_path / "draft"), target)
    hf = load_hf_model(target)
    prompts = [[11, 12, 13, 14, 15], [300, 301]]
    refs = []
    with torch.no_grad():
        for p in prompts:
            gen = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
            g = gen[0, len(p):].tolist()
            refs.append(g[: g.index(EOS) + 1] if EOS in g else g)
    assert_clear_greedy_margins(hf, prompts, refs)  # exact equality below needs no near-ties (greedy_margin)
    os.environ.update(CHILD_ENV)
    engine = sglite.Engine(model_path=target, speculative_algorithm="DFLASH", speculative_draft_model_path=draft,
                           device="cpu", cpu_kv_cache_budget_mb=4, tp_size=2)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0})
        assert [o["output_ids"] for o in outs] == refs
        for o, ref in zip(outs, refs):
            meta = o["meta_info"]
            assert meta["completion_tokens"] == len(ref)
            assert 1 <= meta["spec_verify_ct"] <= len(ref)
            assert meta["spec_accept_length"] == pytest.approx(len(ref) / meta["spec_verify_ct"])
        info = engine.get_server_info()
        assert info["speculative_algorithm"] == "DFLASH"
        assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
        assert info["memory_plan"]["draft_cell_bytes"] > 0
        assert set(info["process_pids"]) == {"scheduler rank 0", "scheduler rank 1", "detokenizer"}
        plans = info["memory_plan_per_rank"]
        assert len(plans) == 2 and plans[0]["max_total_num_tokens"] == plans[1]["max_total_num_tokens"]
        assert plans[0]["attn_tp_size"] == 2
    finally:
        engine.shutdown()
