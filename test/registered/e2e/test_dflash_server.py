"""A DFLASH server on the embedded trained pair: the official openai client gets speculation meta,
the `dflash` package's own OpenAI benchmark client is served as-is, and greedy output equals the
target's greedy decoding in transformers."""

import json
import os

import openai
import pytest
import torch

from sglite.srt.default_model import TOY_DRAFT_DIR, TOY_MODEL_DIR
from sglite.testing.greedy_margin import assert_clear_greedy_margins

from conftest import ServerProcess

SUITE = "e2e-cpu"
EST_TIME = 60

MESSAGES = [{"role": "user", "content": "Write a function that returns the sum of a list."}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("dflash_server") / "server.log")
    srv = ServerProcess(
        TOY_MODEL_DIR, log, "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", TOY_DRAFT_DIR, api_key=None,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def target_greedy_text():
    """The target alone, greedy, in transformers: what a lossless speculative server must return."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TOY_MODEL_DIR, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    # The text is compared exactly, which is CPU-independent only without near-ties (see greedy_margin).
    assert_clear_greedy_margins(model, [ids[0].tolist()], [out[0, ids.shape[1]:].tolist()])
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.timeout(180)
def test_openai_client_gets_spec_meta_and_target_greedy_text(server, target_greedy_text):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_meta_info": True},
    )
    assert resp.choices[0].message.content == target_greedy_text
    meta = resp.model_extra["meta_info"]
    assert meta["completion_tokens"] == resp.usage.completion_tokens
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] > 1.0  # the trained draft really speculates


@pytest.mark.timeout(180)
def test_dflash_package_benchmark_client_body_is_served(server, target_greedy_text):
    # The exact request the DFlash authors' benchmark sends (chat_template_kwargs, return_meta_info, top_k).
    from dflash.benchmark import send_openai

    out = send_openai(
        server.base, MESSAGES, model="tiny", max_new_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, top_k=1,
        timeout_s=120, reasoning=None,
    )
    assert out["choices"][0]["message"]["content"] == target_greedy_text
    assert out["meta_info"]["spec_verify_ct"] >= 1 and out["meta_info"]["spec_accept_length"] > 1.0


@pytest.mark.timeout(180)
def test_chat_logprobs_are_the_targets_own(server):
    """logprobs=true on a DFLASH server: one entry per completion token, equal to the target's teacher-forced
    log-softmax in transformers (accepted drafts and bonus tokens alike)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"return_meta_info": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert resp.model_extra["meta_info"]["spec_accept_length"] > 1.0  # several tokens per verify step
    tok = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TOY_MODEL_DIR, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=len(content), do_sample=False)[0, len(prompt):]
        logits = model(greedy.new_tensor([prompt + greedy.tolist()])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1).gather(1, greedy[:, None]).squeeze(1).tolist()
    assert [c.token for c in content] == [tok.decode([t]) for t in greedy.tolist()]
    assert [c.logprob for c in content] == pytest.approx(ref, abs=1e-3)


@pytest.mark.timeout(240)
def test_sampling_options_and_spec_meta_over_http(server):
    """On the DFLASH server, through the openai client: penalties + logit_bias + min_tokens equal the target's
    greedy under transformers' own processors (lossless verify), n and top logprobs are served, and
    meta_info carries SGLang's spec fields with their 0.5.23 meanings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglite.srt.sampling.sampling_params import SamplingParams
    from sglite.testing.penalty_reference import hf_processed_greedy

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    tok = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TOY_MODEL_DIR, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    plain = hf_processed_greedy(model, prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    bias = {str(plain[3]): -100.0}
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=0.4,
                            presence_penalty=0.3, repetition_penalty=1.1, logit_bias=bias, min_new_tokens=5)
    ref = hf_processed_greedy(model, prompt, params)
    assert ref != plain
    resp = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=24, temperature=0, n=2, frequency_penalty=0.4,
        presence_penalty=0.3, logit_bias=bias, logprobs=True, top_logprobs=3,
        extra_body={"repetition_penalty": 1.1, "min_tokens": 5, "ignore_eos": True, "return_meta_info": True},
    )
    assert [c.message.content for c in resp.choices] == [tok.decode(ref, skip_special_tokens=True)] * 2
    assert all(len(e.top_logprobs) == 3 for c in resp.choices for e in c.logprobs.content)
    with open(os.path.join(TOY_DRAFT_DIR, "config.json")) as f:
        block = json.load(f)["block_size"]
    for meta in resp.model_extra["meta_info"]:
        verifies = meta["spec_verify_ct"]
        assert meta["spec_num_proposed_drafts"] == verifies * (block - 1)  # DFLASH: B - 1 drafts per verify
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
        # Every verify returns its accepted drafts + a bonus; max_tokens may cut the last one short.
        assert meta["spec_num_correct_drafts"] >= meta["completion_tokens"] - 1 - verifies
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / verifies)
