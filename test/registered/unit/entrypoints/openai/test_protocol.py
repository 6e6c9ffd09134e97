"""OpenAI/native request models: unknown fields ignored, null = default, types enforced."""

import pytest
from pydantic import ValidationError

from sglite.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
)

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
