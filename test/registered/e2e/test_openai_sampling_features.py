"""The official openai client against a real server on a tiny Qwen3, for what SGLang serves beyond plain
sampling: any model name, penalties, logit_bias, min_tokens, stop_token_ids, ignore_eos, n > 1, top
logprobs, echo, continuous usage stats, /generate's logprob fields, and the tokenizer / info routes.
Values are checked against transformers (its own logits processors for penalties and bias)."""

import httpx
import openai
import pytest
import torch

from conftest import API_KEY, ServerProcess
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.testing.penalty_reference import hf_processed_greedy

SUITE = "e2e-cpu"
EST_TIME = 70

pytestmark = pytest.mark.timeout(300)
EOS = 2
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("features_log") / "server.log")
    srv = ServerProcess(tiny_model_dir, log, "--served-model-name", "tiny", "--chat-template", "chatml")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def hf_top_logprobs(hf_model, prompt, output, k):
    """Per output position: transformers' k best (ids, logprobs) from log_softmax of its logits."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    values, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return ids.tolist(), values.tolist()


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


OPTIONS = {
    "frequency_penalty": (dict(frequency_penalty=1.5), {}),
    "presence_penalty": (dict(presence_penalty=1.5), {}),
    "repetition_penalty": ({}, dict(repetition_penalty=1.8)),
    # The bias makes EOS the first choice; min_tokens holds it off for 6 tokens.
    "min_tokens": (dict(logit_bias={str(EOS): 8.0}), dict(min_tokens=6)),
    "ignore_eos": (dict(logit_bias={str(EOS): 8.0}), dict(ignore_eos=True)),  # EOS after EOS, never stopping
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_penalties_equal_transformers_processors(server, client, hf_model, hf_tokenizer, name):
    openai_kw, extra = OPTIONS[name]
    sp = dict(max_new_tokens=12, temperature=0.0, ignore_eos=extra.get("ignore_eos", False))
    sp.update(openai_kw)
    sp.update({("min_new_tokens" if k == "min_tokens" else k): v for k, v in extra.items() if k != "ignore_eos"})
    ref = hf_processed_greedy(hf_model, PROMPT, SamplingParams(**sp).verify(), eos_ids=[EOS])
    plain = hf_processed_greedy(hf_model, PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0), eos_ids=[EOS])
    assert ref != plain, f"{name} changed nothing on this prompt"
    if name == "min_tokens":
        assert len(ref) == 7 and ref[-1] == EOS
    res = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, extra_body=extra, **openai_kw
    )
    assert res.choices[0].text == hf_tokenizer.decode(ref, skip_special_tokens=True), name
    gen = httpx.post(server.base + "/generate", headers=server.headers, timeout=120, json={
        "input_ids": PROMPT, "sampling_params": sp}).json()
    assert gen["output_ids"] == ref, name


def test_logit_bias_and_stop_token_ids(server, client, hf_model, hf_tokenizer):
    plain = hf_processed_greedy(hf_model, PROMPT, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    bias = {str(plain[2]): -100.0, str(plain[5]): 5.0}
    ref = hf_processed_greedy(hf_model, PROMPT, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=bias))
    assert ref != plain
    res = client.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias,
                                    extra_body={"ignore_eos": True, "return_meta_info": True})
    assert res.choices[0].text == hf_tokenizer.decode(ref, skip_special_tokens=True)
    stop = plain[4]
    res = client.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert res.choices[0].finish_reason == "stop" and res.choices[0].model_extra["matched_stop"] == stop


def test_n_choices_and_usage(server, client, hf_model, hf_tokenizer):
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 1  # greedy: the same answer three times
    prompt_ids = ids_of(hf_tokenizer, hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert chat.usage.prompt_tokens == len(prompt_ids)  # the prompt counted once
    assert chat.usage.completion_tokens == 3 * 6
    sampled = client.completions.create(model="default", prompt=["ab", "cd"], max_tokens=8, temperature=1.0, seed=3, n=2)
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert sampled.choices[0].text != sampled.choices[1].text  # seeds differ per choice
    again = client.completions.create(model="default", prompt=["ab", "cd"], max_tokens=8, temperature=1.0, seed=3, n=2)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {0: chat.choices[0].message.content, 1: chat.choices[0].message.content}


def test_top_logprobs_equal_transformers(server, client, hf_model, hf_tokenizer):
    res = client.completions.create(model="default", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=4,
                                    extra_body={"ignore_eos": True})
    out = hf_processed_greedy(hf_model, PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    ids, values = hf_top_logprobs(hf_model, PROMPT, out, 4)
    for pos, top in enumerate(res.choices[0].logprobs.top_logprobs):
        # The legacy format keys by text, so byte tokens decoding alike collapse, as they do here.
        expected = dict(zip([hf_tokenizer.decode([t]) for t in ids[pos]], values[pos]))
        assert list(top) == list(expected)
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-3)

    messages = [{"role": "user", "content": "Count."}]
    prompt_ids = ids_of(hf_tokenizer, hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True})
    out = hf_processed_greedy(hf_model, prompt_ids, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    ids, values = hf_top_logprobs(hf_model, prompt_ids, out, 20)
    for pos, entry in enumerate(chat.choices[0].logprobs.content):
        assert [t.token for t in entry.top_logprobs] == [hf_tokenizer.decode([t]) for t in ids[pos]]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values[pos], abs=1e-3)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)

    gen = httpx.post(server.base + "/generate", headers=server.headers, timeout=120, json={
        "input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True,
        "logprob_start_len": -1, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()
    meta = gen["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == gen["output_ids"]
    assert [e[2] for e in meta["output_token_logprobs"]] == [hf_tokenizer.decode([t]) for t in gen["output_ids"]]
    assert [[e[1] for e in top] for top in meta["output_top_logprobs"]] == [row[:3] for row in hf_top_logprobs(hf_model, PROMPT, gen["output_ids"], 3)[0]]


def test_echo_and_continuous_usage(server, client):
    res = client.completions.create(model="default", prompt="hello world", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="default", prompt="hello world", max_tokens=4, temperature=0)
    assert res.choices[0].text == "hello world" + plain.choices[0].text
    chunks = list(client.completions.create(
        model="default", prompt="hello world", max_tokens=6, temperature=0, stream=True, echo=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello world" + client.completions.create(
        model="default", prompt="hello world", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_routes(server, client, hf_tokenizer):
    base, h = server.base, server.headers
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for prefix in ("", "/v1"):
        r = httpx.post(base + prefix + "/tokenize", headers=h, json={"prompt": "hello world"}).json()
        assert r["tokens"] == hf_tokenizer.encode("hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
        d = httpx.post(base + prefix + "/detokenize", headers=h, json={"tokens": r["tokens"]}).json()
        assert d["text"] == hf_tokenizer.decode(r["tokens"], skip_special_tokens=True)
    many = httpx.post(base + "/tokenize", headers=h, json={"prompt": ["a b", "c"], "add_special_tokens": False}).json()
    assert many["tokens"] == [hf_tokenizer.encode(x, add_special_tokens=False) for x in ("a b", "c")]
    assert many["count"] == [len(t) for t in many["tokens"]]
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(base + "/tokenize", headers=h, json={"messages": msgs}).json()
    # --chat-template chatml replaced the tokenizer's own template.
    assert chat["tokens"] == ids_of(hf_tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    info = httpx.get(base + "/model_info", headers=h).json()
    assert info == httpx.get(base + "/get_model_info", headers=h).json()
    assert info["served_model_name"] == "tiny" and info["is_generation"] is True and info["chat_template"] == "chatml"
    for key in ("model_path", "tokenizer_path", "preferred_sampling_params", "weight_version", "load_format",
                "speculative_algorithm", "speculative_draft_model_path"):
        assert key in info
    assert httpx.get(base + "/version", headers=h).json()["version"]
    assert httpx.get(base + "/ready", headers=h).status_code == 200
    assert httpx.get(base + "/server_info", headers=h).json()["version"] == httpx.get(base + "/get_server_info", headers=h).json()["version"]
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def hf_prompt_logprobs(hf_model, ids, k):
    """transformers' logprob of each token given the ones before it (position 0 has none) and the top k."""
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    values, top = logp.topk(k, dim=-1)
    return [None] + chosen, [None] + [list(zip(v, t)) for v, t in zip(values.tolist(), top.tolist())]


@pytest.mark.parametrize("start", [0, 3])
def test_prompt_logprobs_equal_transformers(server, client, hf_model, hf_tokenizer, start):
    prompt = [21, 22, 23, 24, 25, 26, 27]
    lps, tops = hf_prompt_logprobs(hf_model, prompt, 2)
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    for _ in range(2):  # the second run would be a prefix-cache hit; prompt logprobs need the forward anyway
        meta = httpx.post(server.base + "/generate", headers=server.headers, timeout=120, json=body).json()["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:]
        got = [e[0] for e in entries]
        assert (got[0] is None) == (start == 0)
        assert [x for x in got if x is not None] == pytest.approx([x for x in lps[start:] if x is not None], abs=1e-3)
        for row, ref in zip(meta["input_top_logprobs"], tops[start:]):
            assert (row is None) == (ref is None)
            if row is not None:
                assert [e[1] for e in row] == [t for _, t in ref]
                assert [e[0] for e in row] == pytest.approx([v for v, _ in ref], abs=1e-3)
    res = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = res.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1 : len(prompt)] == pytest.approx(lps[1:], abs=1e-3)
    assert len(lp.tokens) == len(prompt) + 2 and "".join(lp.tokens) == res.choices[0].text
