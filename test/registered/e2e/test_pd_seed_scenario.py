"""The seed scenario at tiny scale: an MLA + MoE target (DeepSeek-V3 architecture, as Kimi-K2) with a DSPARK
draft in the released layout, served by a PD decode node at ``--tp-size 2 --dp-size 2 --enable-dp-attention``
behind sglang-router, with a prefill node in front.

- Greedy output through the router equals one plain node (no draft, no PD) and transformers, token for token.
- Every decode rank runs at attention-TP width 1, where the draft's KV is priced with all of its KV heads, and
  each rank allocated exactly the bytes its plan priced, pool by pool.
- A room's KV lands on the decode group the controller picked, from the prefill group that served it; no
  slot leaks on either node.
"""

import os
import signal
import time

import httpx
import pytest
import torch

from pd_cluster import Proc, Router, Server
from conftest import free_port
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.mooncake import needs_mooncake

SUITE = "e2e-cpu"
EST_TIME = 150

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.timeout(600), needs_mooncake()]

NEW_TOKENS = 12
DP_ATTENTION = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny DeepSeek-V3 target (with tokenizer) and a DSPARK draft built from a briefly trained DFLASH one."""
    from sglite.testing.tiny_dflash import build_tiny_dspark_draft, build_tiny_target, train_tiny_draft

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("seed_models")
    target = build_tiny_target(str(root / "target"), with_tokenizer=True, arch="deepseek_v3")
    trained = train_tiny_draft(str(root / "dflash"), target, steps=120, num_prompts=4)
    dspark = build_tiny_dspark_draft(str(root / "dspark"), trained.draft_dir, markov_rank=8, markov_scale=0.3,
                                     with_embeddings=True, target_dir=target)
    return {"target": target, "draft": dspark, "prompts": trained.prompts}


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("seed_logs")
    plain = ["--model-path", models["target"]]
    spec = plain + ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", models["draft"]]
    bootstrap = free_port()
    pd = ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-transfer-timeout", "120"]
    procs: dict = {}
    try:
        procs["prefill"] = Server("prefill", spec, logs, "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(bootstrap), *pd)
        procs["decode"] = Server("decode", spec, logs, *DP_ATTENTION, "--disaggregation-mode", "decode", *pd)
        procs["plain"] = Server("plain", plain, logs)
        deadline = time.monotonic() + 450
        for p in list(procs.values()):
            p.wait_healthy(deadline)
        procs["router"] = Router("router", procs["prefill"], bootstrap, procs["decode"], logs)
        procs["router"].wait_serving(deadline)
        yield procs
    finally:
        running = [p for p in procs.values() if isinstance(p, Proc)]
        for p in running:
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGTERM)
        for p in running:
            p.stop()


def _generate(base, ids):
    r = httpx.post(base + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _info(server):
    return httpx.get(server.base + "/get_server_info", timeout=30).json()


def test_pd_decode_node_with_dp_attention_equals_one_plain_node(cluster, models):
    from sglite.testing.tiny_models import load_hf_model

    hf = load_hf_model(models["target"])
    prompts = models["prompts"][:3] + [[31, 32, 33], list(range(40, 70)), [7, 7, 7, 7, 9]]
    for p in prompts:
        pd = _generate(cluster["router"].base, p)
        plain = _generate(cluster["plain"].base, p)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(p):].tolist()
        assert_clear_greedy_margins(hf, [p], [ref])
        assert pd["output_ids"] == plain["output_ids"] == ref, p
        assert pd["meta_info"]["spec_verify_ct"] >= 1  # the decode node verified DSPARK blocks
    states = _info(cluster["decode"])["internal_states"]
    assert len(states) == 2 and sum(s["num_kv_received"] for s in states) >= len(prompts)
    assert all(s["num_kv_transfer_failed"] == 0 for s in states)
    served = [s["num_kv_received"] for s in states]
    assert min(served) > 0, served  # both attention-DP groups took rooms
    for s in states:  # nothing leaked on either group
        assert s["available_kv_slots"] + s["tree_cache_size"] == s["initial_free_slots"]
    p = _info(cluster["prefill"])["internal_states"][0]
    assert p["num_kv_transfer_failed"] == 0 and p["num_kv_transferred"] >= len(prompts)


def test_every_decode_rank_allocates_its_plan_with_the_draft_at_attn_tp_1(cluster, models):
    import json

    with open(os.path.join(models["draft"], "config.json")) as f:
        draft_kv_heads = json.load(f)["num_key_value_heads"]
    info = _info(cluster["decode"])
    ranks = info["ranks"]
    assert [r["attn_tp_size"] for r in ranks] == [1, 1] and sorted(r["dp_rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["target_kv_heads_per_rank"] is None  # MLA: one latent per token, not heads
        assert r["draft_kv_heads_per_rank"] == draft_kv_heads  # priced at attn_tp 1, not at tp 2
        assert r["planned_pool_bytes"] and r["planned_pool_bytes"] == {
            k: v for k, v in r["allocated_pool_bytes"].items() if k in r["planned_pool_bytes"]}
        assert r["allocated_draft_kv_bytes"] == r["planned_draft_kv_bytes"] > 0
