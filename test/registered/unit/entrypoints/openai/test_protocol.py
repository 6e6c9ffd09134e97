"""OpenAI/native request models: unknown fields ignored, null = default, strict types, unserved options refused."""

import dataclasses

import pytest
from pydantic import ValidationError

from sglite.srt.entrypoints.openai.protocol import (
    REFUSED_ERROR,
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingParamsRequest,
    error_body,
)
from sglite.srt.sampling.sampling_params import SamplingParams

SUITE = "unit-cpu"
EST_TIME = 1


def test_router_fields_are_ignored_and_nulls_mean_default():
    body = {
        "model": "m", "messages": [{"role": "user", "content": "hi", "reasoning_content": None}],
        "max_tokens": None, "max_completion_tokens": 5, "n": None, "stream": None, "skip_special_tokens": None,
        "log_metrics": True, "no_stop_trim": False, "separate_reasoning": True, "return_hidden_states": False,
        "bootstrap_host": "10.0.0.1", "bootstrap_port": None, "bootstrap_room": 12345,
    }
    r = ChatCompletionRequest.model_validate(body)
    assert (r.n, r.stream, r.skip_special_tokens, r.max_tokens, r.max_completion_tokens) == (1, False, True, None, 5)
    assert (r.bootstrap_host, r.bootstrap_port, r.bootstrap_room) == ("10.0.0.1", None, 12345)
    assert not hasattr(r, "log_metrics")


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1], [2, 3]]])
def test_completion_prompt_shapes(prompt):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt


def test_completion_default_max_tokens_is_openai_16():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).max_tokens == 16


@pytest.mark.parametrize(
    "cls, body",
    [
        (ChatCompletionRequest, {"model": "m", "messages": []}),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}),
        (CompletionRequest, {"model": "m", "prompt": {"a": 1}}),
        (CompletionRequest, {"model": "m", "prompt": "x", "stop": 5}),
        (GenerateRequest, {"text": 5}),
        (GenerateRequest, {"input_ids": ["a"]}),
    ],
)
def test_wrong_types_are_rejected(cls, body):
    with pytest.raises(ValidationError):
        cls.model_validate(body)


def test_error_body_shape():
    assert error_body("bad", param="top_p") == {
        "object": "error", "message": "bad", "type": "BadRequestError", "param": "top_p", "code": 400,
    }


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    "cls, body, field",
    [
        (ChatCompletionRequest, {**CHAT, "max_tokens": True}, "max_tokens"),
        (ChatCompletionRequest, {**CHAT, "stream": "yes"}, "stream"),
        (ChatCompletionRequest, {**CHAT, "stream": 1}, "stream"),
        (ChatCompletionRequest, {**CHAT, "temperature": False}, "temperature"),
        (ChatCompletionRequest, {**CHAT, "seed": 3.0}, "seed"),
        (ChatCompletionRequest, {**CHAT, "stop_token_ids": [True]}, "stop_token_ids"),
        (CompletionRequest, {"model": "m", "prompt": [True, False]}, "prompt"),
        (CompletionRequest, {"model": "m", "prompt": "x", "echo": "false"}, "echo"),
        (GenerateRequest, {"input_ids": [True, False]}, "input_ids"),
        (GenerateRequest, {"text": "a", "sampling_params": {"skip_special_tokens": "no"}}, "sampling_params"),
        (GenerateRequest, {"text": "a", "sampling_params": [{"ignore_eos": 1}]}, "sampling_params"),
        (GenerateRequest, {"text": "a", "return_logprob": "true"}, "return_logprob"),
        (AbortRequest, {"abort_all": "yes"}, "abort_all"),
    ],
)
def test_no_coercion(cls, body, field):
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == field


def test_json_integers_are_accepted_as_floats():
    r = ChatCompletionRequest.model_validate({**CHAT, "temperature": 1, "top_p": 1})
    assert (r.temperature, r.top_p) == (1.0, 1.0) and isinstance(r.temperature, float)


@pytest.mark.parametrize(
    "cls, body, name",
    [
        (ChatCompletionRequest, {**CHAT, "functions": [{"name": "f"}]}, "functions"),
        (ChatCompletionRequest, {**CHAT, "regex": "a+"}, "regex"),
        (CompletionRequest, {"model": "m", "prompt": "x", "lora_path": "a"}, "lora_path"),
        (GenerateRequest, {"text": "a", "return_hidden_states": True}, "return_hidden_states"),
        (GenerateRequest, {"text": "a", "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ],
)
def test_unserved_options_are_refused_by_name(cls, body, name):
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    err = next(e for e in info.value.errors() if e["type"] == REFUSED_ERROR)
    assert err["ctx"]["name"] == name and name in err["msg"]


def test_unserved_options_sent_unset_are_accepted():
    # Routers write these as false / null / empty; that asks for nothing.
    ChatCompletionRequest.model_validate({**CHAT, "return_hidden_states": False, "functions": None, "regex": ""})
    GenerateRequest.model_validate({"text": "a", "lora_path": None, "sampling_params": {"regex": None}})


def test_native_sampling_params_model_has_the_engine_fields():
    assert set(SamplingParamsRequest.model_fields) == {f.name for f in dataclasses.fields(SamplingParams)}
    sp = GenerateRequest.model_validate({"text": "a", "sampling_params": {"stop": "x", "max_new_tokens": 3}})
    assert SamplingParams.from_dict(sp.model_dump()["sampling_params"]).stop == ["x"]
