"""Request models of the OpenAI-compatible and native APIs (pydantic; unknown fields are ignored).

Routers such as sglang-router re-serialize bodies and add fields of their own (``log_metrics``,
``no_stop_trim``, ``bootstrap_room`` ...), so every model ignores extra keys. Types are checked
here; value ranges are checked by ``SamplingParams.verify`` so every endpoint shares one rule set.
Responses are plain dicts built by the serving classes.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from sglite.srt.managers.io_struct import GenerateReqInput


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Re-serializing gateways write `null` for options they do not set; treat it as "absent".
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data


class StreamOptions(_Lenient):
    """OpenAI ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Lenient):
    """One part of a multi-part message content (only text is served)."""

    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class _SamplingFields(_Lenient):
    """Fields shared by chat and completions (OpenAI names plus SGLang/vLLM extensions)."""

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
    user: Optional[str] = None
    return_meta_info: bool = False
    rid: Optional[str] = None
    # PD disaggregation fields added by the router.
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


def _model_of_dataclass(name: str, dataclass_type: type, doc: str) -> type[_Lenient]:
    """A lenient pydantic model with exactly the fields, types and defaults of dataclass_type."""
    hints = typing.get_type_hints(dataclass_type)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(dataclass_type):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{dataclass_type.__name__}.{f.name} has no plain default; the request model needs one")
        fields[f.name] = (hints[f.name], f.default)
    model = create_model(name, __base__=_Lenient, __doc__=doc, **fields)
    model.__module__ = __name__
    return model


# POST /generate: the body is GenerateReqInput itself (one definition of the native fields).
GenerateRequest = _model_of_dataclass("GenerateRequest", GenerateReqInput, "POST /generate (SGLang's native body).")


class AbortRequest(_Lenient):
    """POST /abort_request."""

    rid: str = ""
    abort_all: bool = False


def error_body(message: str, *, err_type: str = "BadRequestError", param: Optional[str] = None, code: int = 400) -> dict[str, Any]:
    """The OpenAI-style error object (as SGLang and vLLM return it)."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": code}
