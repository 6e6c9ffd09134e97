"""Request models of the OpenAI-compatible and native APIs (pydantic, strict types; unknown fields are ignored).

Routers such as sglang-router re-serialize bodies and add fields of their own (``log_metrics``,
``no_stop_trim``, ``bootstrap_room`` ...), so every model ignores extra keys and reads ``null`` as
"default". Types are strict (pydantic strict mode): ``true`` is not an integer, ``"yes"`` is not a
boolean, ``1.0`` is not a token id; a JSON integer is accepted where a float is expected. Value
ranges are checked by ``SamplingParams.verify`` so every endpoint shares one rule set. Options that
clients send but this server does not implement are listed in their model's ``REFUSED`` and fail
validation with a ``REFUSED_ERROR`` naming them (the HTTP layer answers 400 with that ``param``).
Responses are plain dicts built by the serving classes.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from sglite.srt.managers.io_struct import GenerateReqInput
from sglite.srt.sampling.sampling_params import SamplingParams


class _Lenient(BaseModel):
    """Base of every request model: lenient about unknown keys and nulls, strict about types."""

    model_config = ConfigDict(extra="ignore", strict=True)
    # Option name -> what it asks for: options clients send that this server does not implement.
    REFUSED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved_options(cls, data: Any) -> Any:
        # Undeclared keys are ignored, so an unserved option must be refused before that happens.
        if isinstance(data, dict):
            for name, what in cls.REFUSED.items():
                if data.get(name) not in _UNSET_VALUES:
                    raise PydanticCustomError(
                        REFUSED_ERROR, "{name} is not supported by this server ({what}); omit it",
                        {"name": name, "what": what},
                    )
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Re-serializing gateways write `null` for options they do not set; treat it as "absent".
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data


# pydantic error type of a refused option; its ctx["name"] is the option (the error's `param`).
REFUSED_ERROR = "refused_option"
# A refused option sent with one of these values asks for nothing (routers write `false` / `null` / `[]`).
_UNSET_VALUES = (None, False, "", [], {})
# SGLang's constrained-decoding options (no grammar backend here).
_CONSTRAINED_DECODING = {
    "regex": "regex-constrained decoding",
    "ebnf": "grammar-constrained decoding",
    "json_schema": "JSON-schema-constrained decoding",
    "structural_tag": "structural-tag-constrained decoding",
}
# SGLang extensions of every generation route that need machinery this server does not have.
_UNSERVED_EXTENSIONS = {
    "lora_path": "LoRA adapters",
    "return_hidden_states": "hidden-state output",
    "image_data": "image input",
    "audio_data": "audio input",
    "video_data": "video input",
}


class StreamOptions(_Lenient):
    """OpenAI ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Lenient):
    """One part of a multi-part message content (only text is served)."""

    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    """One chat message. A history of tool calls is refused (tools are not served), never silently dropped."""

    REFUSED: ClassVar[dict[str, str]] = {
        "tool_calls": "an assistant message's tool calls: tool calling",
        "tool_call_id": "a tool result message: tool calling",
        "function_call": "a legacy function call: tool calling",
    }
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class _SamplingFields(_Lenient):
    """Fields shared by chat and completions (OpenAI names plus SGLang/vLLM extensions)."""

    REFUSED: ClassVar[dict[str, str]] = {**_CONSTRAINED_DECODING, **_UNSERVED_EXTENSIONS}
    model: str
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = 1
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None  # SGLang's min_new_tokens
    logit_bias: Optional[dict[str, float]] = None  # token id (JSON key) -> bias in [-100, 100]
    user: Optional[str] = None
    return_meta_info: bool = False
    rid: Optional[str] = None
    # PD disaggregation fields added by the router.
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = Field(None, ge=1, le=65535)
    bootstrap_room: Optional[int] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    REFUSED: ClassVar[dict[str, str]] = {
        **_SamplingFields.REFUSED,
        "functions": "function calling",
        "function_call": "function calling",
        "audio": "audio output",
        "prediction": "predicted outputs",
        "web_search_options": "web search",
        "reasoning_effort": "reasoning options",
    }
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    # A client-supplied template (vLLM's field): refused unless the server trusts request templates.
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0)
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)


def _model_of_dataclass(
    name: str, dataclass_type: type, doc: str, *, optional: bool = False,
    overrides: Optional[dict[str, Any]] = None, refused: Optional[dict[str, str]] = None,
) -> type[_Lenient]:
    """A request model with exactly the fields, types and defaults of dataclass_type.

    ``optional`` makes every field ``Optional[...] = None`` (absent = the server's default);
    ``overrides`` replaces the wire type of some fields; ``refused`` becomes the model's REFUSED."""
    hints = typing.get_type_hints(dataclass_type)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(dataclass_type):
        hint = (overrides or {}).get(f.name, hints[f.name])
        if optional:
            fields[f.name] = (Optional[hint], None)
        elif f.default is dataclasses.MISSING:
            raise TypeError(f"{dataclass_type.__name__}.{f.name} has no plain default; the request model needs one")
        else:
            fields[f.name] = (hint, f.default)
    model = create_model(name, __base__=_Lenient, __doc__=doc, **fields)
    model.REFUSED = dict(refused or {})  # a ClassVar of _Lenient, read by its validator
    model.__module__ = __name__
    return model


# The native ``sampling_params`` object: SamplingParams' own fields (``stop`` may be one string).
SamplingParamsRequest = _model_of_dataclass(
    "SamplingParamsRequest", SamplingParams, "SGLang's native sampling_params (every field optional).",
    optional=True, overrides={"stop": Union[str, list[str]]}, refused=_CONSTRAINED_DECODING,
)

# POST /generate: the body is GenerateReqInput itself (one definition of the native fields).
GenerateRequest = _model_of_dataclass(
    "GenerateRequest", GenerateReqInput, "POST /generate (SGLang's native body).",
    overrides={"sampling_params": Optional[Union[SamplingParamsRequest, list[SamplingParamsRequest]]]},
    refused=_UNSERVED_EXTENSIONS,
)


class TokenizeRequest(_Lenient):
    """POST /tokenize and /v1/tokenize: exactly one of ``prompt`` and ``messages`` (SGLang's shape)."""

    model: Optional[str] = None
    prompt: Optional[Union[str, list[str]]] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Lenient):
    """POST /detokenize and /v1/detokenize."""

    model: Optional[str] = None
    tokens: list[int]
    skip_special_tokens: bool = True


class AbortRequest(_Lenient):
    """POST /abort_request."""

    rid: str = ""
    abort_all: bool = False


def error_body(message: str, *, err_type: str = "BadRequestError", param: Optional[str] = None, code: int = 400) -> dict[str, Any]:
    """The OpenAI-style error object (as SGLang and vLLM return it)."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": code}
