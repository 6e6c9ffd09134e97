"""PD disaggregation on 127.0.0.1: prefill node + decode node behind sglang-router (--pd-disaggregation),
KV moved by Mooncake over TCP.

References: transformers' greedy decoding of the target (plain pair) and a single sglite node running
the same DFLASH target + draft (speculative pair: same tokens, same verify count per request, same
average acceptance length). Failure: a prefill node SIGKILLed while the decode node waits for a
room's KV -> the client gets an abort with the reason, the decode node's slots return, it keeps serving.

All servers of the module start in parallel once (the box has 2 cores).
"""

import json
import os
import signal
import threading
import time

import httpx
import pytest
import torch

from conftest import free_port
from pd_cluster import Proc, Router, Server
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.mooncake import needs_mooncake

SUITE = "e2e-cpu"
EST_TIME = 120

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.timeout(600), needs_mooncake()]

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny target (with tokenizer) + a briefly trained DFLASH draft (acceptance > 1 on its prompts)."""
    from sglite.testing.tiny_dflash import build_tiny_target, train_tiny_draft

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pd_models")
    target = build_tiny_target(str(root / "target"), with_tokenizer=True)
    trained = train_tiny_draft(str(root / "draft"), target, steps=120, num_prompts=4)
    return {"target": target, "draft": trained.draft_dir, "prompts": trained.prompts}


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    """Plain PD pair, DFLASH PD pair, single DFLASH node, and a router per pair."""
    logs = tmp_path_factory.mktemp("pd_logs")
    plain = ["--model-path", models["target"]]
    spec = plain + ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", models["draft"]]
    bp_plain, bp_spec = free_port(), free_port()
    pd = ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-transfer-timeout", "120"]
    procs: dict = {}
    try:
        procs["p_plain"] = Server("p_plain", plain, logs, "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(bp_plain), *pd)
        procs["d_plain"] = Server("d_plain", plain, logs, "--disaggregation-mode", "decode", *pd)
        procs["p_spec"] = Server("p_spec", spec, logs, "--disaggregation-mode", "prefill",
                                 "--disaggregation-bootstrap-port", str(bp_spec), *pd)
        procs["d_spec"] = Server("d_spec", spec, logs, "--disaggregation-mode", "decode", *pd)
        procs["single_spec"] = Server("single_spec", spec, logs)
        deadline = time.monotonic() + 400
        for p in list(procs.values()):
            p.wait_healthy(deadline)
        procs["r_plain"] = Router("r_plain", procs["p_plain"], bp_plain, procs["d_plain"], logs)
        procs["r_spec"] = Router("r_spec", procs["p_spec"], bp_spec, procs["d_spec"], logs)
        procs["r_plain"].wait_serving(deadline)
        procs["r_spec"].wait_serving(deadline)
        procs["bootstrap_port_plain"] = bp_plain
        yield procs
    finally:
        running = [p for p in procs.values() if isinstance(p, Proc)]
        for p in running:  # signal every server first so they shut down in parallel
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGTERM)
        for p in running:
            p.stop()


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoTokenizer

    from sglite.testing.tiny_models import load_hf_model

    torch.set_num_threads(1)
    return load_hf_model(models["target"]), AutoTokenizer.from_pretrained(models["target"])


def hf_greedy(hf, prompt_ids, max_new_tokens):
    """transformers greedy continuation, stopping after the tokenizer's EOS (the servers stop there too)."""
    model, tok = hf
    eos = tok.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    gen = out[0, len(prompt_ids):].tolist()
    gen = gen[: gen.index(eos) + 1] if eos is not None and eos in gen else gen
    # Tokens are compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(model, [prompt_ids], [gen])
    return gen


def generate(base, ids, **extra):
    r = httpx.post(base + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_router_sees_pd_roles(cluster):
    for name, mode in [("p_plain", "prefill"), ("d_spec", "decode")]:
        info = httpx.get(cluster[name].base + "/get_server_info", timeout=30).json()
        assert info["disaggregation_mode"] == mode
        for key in ("model_path", "tp_size", "dp_size", "tokenizer_path", "is_generation"):
            assert info[key] is not None, key
        assert info["internal_states"][0]["disaggregation_mode"] == mode


def test_plain_pd_equals_transformers(cluster, models, hf):
    router = cluster["r_plain"].base
    prompts = models["prompts"][:2] + [[31, 32, 33], list(range(40, 90))]
    for p in prompts:
        out = generate(router, p)
        assert out["output_ids"] == hf_greedy(hf, p, NEW_TOKENS)
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    # Chat through the router (it rewrites max_tokens as max_completion_tokens and adds its own fields).
    messages = [{"role": "user", "content": "Write one line of Python."}]
    r = httpx.post(router + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    tok = hf[1]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(hf_greedy(hf, ids, 12), skip_special_tokens=True)
    # Streaming (SSE passes through the router from the decode node).
    chunks = []
    with httpx.stream("POST", router + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "def main():", "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks += [c["text"] for c in json.loads(line[5:])["choices"]]
    pids = tok.encode("def main():")
    assert "".join(chunks) == tok.decode(hf_greedy(hf, pids, 6), skip_special_tokens=True)
    d, p = cluster["d_plain"].state(), cluster["p_plain"].state()
    assert d["num_kv_received"] >= len(prompts) + 2 and d["num_kv_transfer_failed"] == 0
    assert p["num_kv_transferred"] >= len(prompts) + 2
    assert d["available_kv_slots"] + d["tree_cache_size"] == d["initial_free_slots"]  # nothing leaked


def test_dflash_pd_equals_single_node(cluster, models, hf):
    prompts = models["prompts"] + [[31, 32, 33]]
    for p in prompts:
        pd = generate(cluster["r_spec"].base, p)
        single = generate(cluster["single_spec"].base, p)
        assert pd["output_ids"] == single["output_ids"] == hf_greedy(hf, p, NEW_TOKENS)
        assert pd["meta_info"]["spec_verify_ct"] == single["meta_info"]["spec_verify_ct"]
        assert pd["meta_info"]["spec_accept_length"] == pytest.approx(single["meta_info"]["spec_accept_length"])
    d, s = cluster["d_spec"].state(), cluster["single_spec"].state()
    # Same requests on both (plus the router's 1-token warm-up, which the decode node finishes without a verify).
    assert d["avg_spec_accept_length"] == pytest.approx(s["avg_spec_accept_length"])
    assert d["avg_spec_accept_length"] > 1.0  # the trained draft really speculates
    p = cluster["p_spec"].state()
    plan = httpx.get(cluster["p_spec"].base + "/get_server_info", timeout=30).json()["memory_plan"]
    single_plan = httpx.get(cluster["single_spec"].base + "/get_server_info", timeout=30).json()["memory_plan"]
    # The prefill node holds no verify-block columns in its req->token rows.
    assert plan["req_to_token_context_len"] < single_plan["req_to_token_context_len"]
    assert p["num_kv_transfer_failed"] == 0


def test_prefill_killed_mid_transfer(cluster):
    decode, prefill = cluster["d_plain"], cluster["p_plain"]
    before = decode.state()
    result: dict = {}

    def call() -> None:
        # Sent to the decode node only: its room waits for KV that the prefill node will never send.
        result["r"] = httpx.post(decode.base + "/generate", timeout=120, json={
            "input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bootstrap_port_plain"],
            "bootstrap_room": 987654321})

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 60
    while decode.state()["num_decode_transfer_queue_reqs"] != 1:
        assert time.monotonic() < deadline, "the decode node never pre-allocated the room"
        time.sleep(0.2)
    assert decode.state()["available_kv_slots"] == before["available_kv_slots"] - 50  # pre-allocated
    prefill.kill()
    t.join(60)
    assert not t.is_alive()
    # The client gets a server error naming the cause.
    assert result["r"].status_code == 500, result["r"].text
    assert "prefill node stopped answering" in result["r"].json()["message"]
    after = decode.state()
    assert after["available_kv_slots"] == before["available_kv_slots"]  # pre-allocated slots are back
    assert after["num_decode_transfer_queue_reqs"] == 0 and after["num_decode_prealloc_queue_reqs"] == 0

    # Through the router: the prefill node is gone, so the client gets an error, not a hang.
    r = httpx.post(cluster["r_plain"].base + "/generate", timeout=180, json={
        "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code >= 500, r.text
    # The decode node is still healthy and its free KV slots return to their value before the failures.
    assert httpx.get(decode.base + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        st = decode.state()
        if st["num_decode_transfer_queue_reqs"] == 0 and st["num_decode_prealloc_queue_reqs"] == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert st["available_kv_slots"] == before["available_kv_slots"]
    assert st["available_kv_slots"] + st["tree_cache_size"] == st["initial_free_slots"]
    # A later request naming the dead prefill node fails cleanly (refused route, or its /health stays down).
    r = httpx.post(decode.base + "/generate", timeout=60, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster["bootstrap_port_plain"], "bootstrap_room": 42})
    assert r.status_code == 500 and "prefill" in r.json()["message"], r.text
    # A request without bootstrap fields is the client's mistake (400).
    r = httpx.post(decode.base + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "decode node" in r.json()["message"], r.text
    assert decode.state()["available_kv_slots"] == before["available_kv_slots"]
