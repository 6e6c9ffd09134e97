"""TP / DP / DP-attention serving across processes (CPU, gloo, tiny Qwen3 + tiny random DFLASH draft).

Greedy outputs equal transformers' greedy output of the target (= what tp=1 serves) for `--dp-size 2`
replicas and `--tp-size 2 --dp-size 2 --enable-dp-attention`, with and without DFLASH (`--tp-size 2` is
covered by test_engine_speculative.py and unit/managers/test_scheduler_process.py). The DP-attention
DFLASH server must price the draft at attn_tp_size (1), not tp_size (2): its per-rank report shows 2
draft KV heads and the matching cell, equal to the allocated draft pool. Killing one scheduler rank of
the DP-attention HTTP server makes /health 503 and the server exit with a message naming the rank.
"""

import json
import os
import signal

import httpx
import pytest
import torch

from conftest import CHILD_ENV, ServerProcess
from sglite.testing.greedy_margin import assert_clear_greedy_margins

SUITE = "e2e-cpu"
EST_TIME = 220

pytestmark = pytest.mark.timeout(400)
EOS = 2
PROMPTS = [[11, 12, 13, 14, 15], [300, 301], [5, 6, 7], [40, 41, 42, 43]]
MAX_NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, draft dir, transformers greedy outputs of the target)."""
    from sglite.testing.tiny_dflash import build_tiny_dflash_draft
    from sglite.testing.tiny_models import build_tiny_model, load_hf_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("parallel")
    target = build_tiny_model(str(root / "target"), "qwen3", num_hidden_layers=4)
    draft = build_tiny_dflash_draft(str(root / "draft"), target)
    hf = load_hf_model(target)
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            gen = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
            g = gen[0, len(p):].tolist()
            refs.append(g[: g.index(EOS) + 1] if EOS in g else g)
    assert_clear_greedy_margins(hf, PROMPTS, refs)  # exact equality later needs no near-ties (greedy_margin)
    return target, draft, refs


def _engine(target: str, **kwargs):
    import sglite

    os.environ.update(CHILD_ENV)
    return sglite.Engine(model_path=target, device="cpu", cpu_kv_cache_budget_mb=4, **kwargs)


def _check_both_groups_served(info: dict) -> None:
    states = info["internal_states"]
    assert [s["dp_rank"] for s in states] == [0, 1]
    # Each group cached some finished request's tokens: the controller dispatched to both.
    assert all(s["tree_cache_size"] > 0 for s in states), states


def _draft_cell_bytes(draft_dir: str, kv_heads_per_rank: int) -> int:
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads_per_rank * head_dim * 4  # K and V, fp32


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_dp_replicas_greedy_equal(pair, speculative):
    target, draft, refs = pair
    spec = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": draft} if speculative else {}
    method = "round_robin" if speculative else "shortest_queue"
    engine = _engine(target, dp_size=2, load_balance_method=method, **spec)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        assert [o["output_ids"] for o in outs] == refs
        info = engine.get_server_info()
        _check_both_groups_served(info)
        ranks = info["ranks"]
        assert [(r["global_rank"], r["dp_rank"], r["attn_tp_size"], r["attn_dp_size"]) for r in ranks] == [
            (0, 0, 1, 1), (1, 1, 1, 1)
        ]
        for r in ranks:
            assert r["allocated_target_kv_bytes"] == r["planned_target_kv_bytes"]
            assert r["allocated_draft_kv_bytes"] == r["planned_draft_kv_bytes"]
            assert (r["allocated_draft_kv_bytes"] > 0) == speculative
    finally:
        engine.shutdown()


def test_dp_attention_dflash_prices_draft_at_attn_tp(pair):
    target, draft, refs = pair
    engine = _engine(target, tp_size=2, dp_size=2, enable_dp_attention=True,
                     speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        assert [o["output_ids"] for o in outs] == refs
        info = engine.get_server_info()
        _check_both_groups_served(info)
        assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
        for r in info["ranks"]:
            assert (r["attn_tp_size"], r["attn_dp_size"]) == (1, 2)
            # attn_tp 1: every rank holds all 2 KV heads of target and draft (tp_size 2 would give 1).
            assert r["target_kv_heads_per_rank"] == 2
            assert r["draft_kv_heads_per_rank"] == 2
            assert r["draft_cell_bytes"] == _draft_cell_bytes(draft, 2)
            page = 1
            assert r["allocated_draft_kv_bytes"] == (r["max_total_num_tokens"] + page) * r["draft_cell_bytes"]
            assert r["allocated_draft_kv_bytes"] == r["planned_draft_kv_bytes"]
            assert r["allocated_target_kv_bytes"] == r["planned_target_kv_bytes"]
        assert [r["attn_dp_rank"] for r in info["ranks"]] == [0, 1]
        assert all(plan["attn_tp_size"] == 1 for plan in info["memory_plan_per_rank"])
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def dp_attention_server(pair, tmp_path_factory):
    target, _, _ = pair
    log = str(tmp_path_factory.mktemp("dpattn_server") / "server.log")
    server = ServerProcess(target, log, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", timeout_s=300)
    yield server
    server.stop()


def test_dp_attention_http_greedy_equal(pair, dp_attention_server):
    _, _, refs = pair
    s = dp_attention_server
    r = httpx.post(s.base + "/generate", headers=s.headers, timeout=120, json={
        "input_ids": PROMPTS, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
    })
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == refs
    info = httpx.get(s.base + "/get_server_info", headers=s.headers, timeout=30).json()
    _check_both_groups_served(info)
    assert [(r["rank"], r["attn_tp_size"], r["attn_dp_size"], r["target_kv_heads_per_rank"]) for r in info["ranks"]] == [
        (0, 1, 2, 2), (1, 1, 2, 2)
    ]


def test_dead_rank_makes_server_unhealthy_and_exit(dp_attention_server):
    s = dp_attention_server
    info = httpx.get(s.base + "/get_server_info", headers=s.headers, timeout=30).json()
    victim = info["process_pids"]["scheduler rank 1 (dp_rank 1)"]
    os.kill(victim, signal.SIGKILL)
    saw_503 = s.watch_health_until_exit(60, poll_s=0.2)
    assert s.proc.poll() is not None, "the server kept running with a dead scheduler rank"
    assert s.proc.returncode != 0
    log = s.output()
    assert "scheduler rank 1 (dp_rank 1)" in log and "exited unexpectedly" in log, log[-3000:]
    # /health may not be polled in the short window before exit; when it was, it said 503.
    assert saw_503 or "shutting the server down" in log
