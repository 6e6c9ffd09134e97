"""POST /v1/chat/completions: messages -> chat template -> generate -> OpenAI chat objects."""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Optional

from fastapi.responses import Response

from sglite.srt.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from sglite.srt.entrypoints.openai.serving_base import OpenAIServingBase, finish_reason_str, sse
from sglite.srt.entrypoints.openai.template_worker import TemplateRenderError, TemplateWorker
from sglite.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglite.srt.managers.tokenizer_manager import RequestValidationError, TokenizerManager


def text_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them: {role, content[, name]}, multi-part text contents joined."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise RequestValidationError(
                        f"messages[{i}].content: only text parts are supported, got type {part.type!r}", "messages"
                    )
                texts.append(part.text)
            content = "".join(texts)
        message = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class OpenAIServingChat(OpenAIServingBase):
    """Chat completions, streaming or not."""

    request_model = ChatCompletionRequest
    prompt_param = "messages"

    def __init__(
        self, tokenizer_manager: TokenizerManager, served_model_name: str,
        *, template_worker: Optional[TemplateWorker] = None, max_prompt_chars: int = 1 << 20,
    ) -> None:
        super().__init__(tokenizer_manager, served_model_name)
        # Set only with --trust-request-chat-template: renders client-supplied templates, time-limited.
        self.template_worker = template_worker
        self.max_prompt_chars = max_prompt_chars
        # chat_template_kwargs keys that would steer apply_chat_template itself rather than the template.
        self.reserved_template_kwargs = _apply_chat_template_params(tokenizer_manager.tokenizer)

    def check_unsupported(self, req: ChatCompletionRequest) -> None:
        """Also reject top_logprobs without logprobs, tools, structured output and untrusted or steering template options."""
        super().check_unsupported(req)
        if req.top_logprobs and not req.logprobs:
            raise RequestValidationError("top_logprobs needs logprobs=true", "top_logprobs")
        if req.tools:
            raise RequestValidationError("tools are not supported by this server", "tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise RequestValidationError("tool_choice other than 'none' or 'auto' needs tools, which this server does not support", "tool_choice")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise RequestValidationError("only response_format type 'text' is supported", "response_format")
        kwargs = req.chat_template_kwargs or {}
        steering = sorted(self.reserved_template_kwargs & kwargs.keys())
        if steering:
            raise RequestValidationError(f"chat_template_kwargs.{steering[0]} is set by the server; omit it", "chat_template_kwargs")
        if self.client_template(req) is not None and self.template_worker is None:
            raise RequestValidationError(
                "a chat template sent in the request is refused: this server renders only its model's template "
                "(start it with --trust-request-chat-template to allow client templates)",
                "chat_template" if req.chat_template is not None else "chat_template_kwargs",
            )

    @staticmethod
    def client_template(req: ChatCompletionRequest) -> Optional[str]:
        """The template the client sent (the ``chat_template`` field or kwarg), or None."""
        if req.chat_template is not None:
            return req.chat_template
        return (req.chat_template_kwargs or {}).get("chat_template")

    def template_messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages as the chat template reads them (text content only)."""
        return text_messages(req.messages)

    async def prepare(self, req: ChatCompletionRequest) -> GenerateReqInput:
        """Render a client template (trusted servers only) in the time-limited worker, then convert off the loop."""
        template = self.client_template(req)
        if template is None or self.template_worker is None:
            return await self.tm.run_off_loop(self.convert, req)
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
        # The tokenizer's special tokens (bos_token, eos_token ...) are template variables, as in transformers.
        special = {k: v for k, v in self.tm.tokenizer.special_tokens_map.items() if isinstance(v, str)}
        try:
            prompt = await self.template_worker.render(
                template, self.template_messages(req), {**special, **kwargs}, self.max_prompt_chars
            )
        except TemplateRenderError as e:
            raise RequestValidationError(str(e), "chat_template") from None
        return await self.tm.run_off_loop(self.convert, req, prompt)

    def convert(self, req: ChatCompletionRequest, prompt: Optional[str] = None) -> GenerateReqInput:
        """Encode the prompt (rendered with the tokenizer's chat template unless given) into the engine request."""
        if prompt is None:
            prompt = self.tm.apply_chat_template(self.template_messages(req), req.chat_template_kwargs)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # The template already placed every special token; encoding must not add a second BOS.
        input_ids = self.tm.tokenizer.encode(prompt, add_special_tokens=False)
        return GenerateReqInput(
            input_ids=input_ids,
            sampling_params=self.sampling_params(req, max_new),
            rid=req.rid,
            stream=req.stream,
            return_logprob=bool(req.logprobs),
            top_logprobs_num=req.top_logprobs or 0,
            bootstrap_host=req.bootstrap_host,
            bootstrap_port=req.bootstrap_port,
            bootstrap_room=req.bootstrap_room,
        )

    async def respond_full(self, req: ChatCompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> Response:
        """One chat.completion object with n choices."""
        return await self.full_response(req, obj, tokenized, "chat.completion", "chatcmpl", lambda out: {
            "message": {"role": "assistant", "content": out["text"]},
            "logprobs": self.chat_logprobs(out["meta_info"]) if req.logprobs else None,
        })

    async def stream_chunks(self, req: ChatCompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> AsyncIterator[str]:
        """chat.completion.chunk events per choice: role first, then content deltas, then finish; usage last."""
        cid, created = self.new_id("chatcmpl"), self.now()
        options = req.stream_options

        def chunk(index: int, delta: dict[str, Any], finish: Any = None, logprobs: Any = None, **extra: Any) -> dict[str, Any]:
            return {
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra,
            }

        for index in range(len(tokenized)):
            yield sse(chunk(index, {"role": "assistant", "content": ""}))
        metas: dict[int, dict[str, Any]] = {}
        logprobs_sent: dict[int, int] = {}  # per choice: output tokens whose logprobs went out in earlier chunks
        async for out in self.tm.generate_request(obj, tokenized):
            index, meta = out["index"], out["meta_info"]
            metas[index] = meta
            # continuous_usage_stats: every chunk carries this choice's running usage (SGLang / vLLM).
            extra: dict[str, Any] = {"usage": self.meta_usage(meta)} if options and options.continuous_usage_stats else {}
            if out["delta_text"]:
                logprobs = None
                if req.logprobs:
                    logprobs = self.chat_logprobs(meta, logprobs_sent.get(index, 0))
                    logprobs_sent[index] = len(meta.get("output_token_logprobs") or [])
                yield sse(chunk(index, {"content": out["delta_text"]}, logprobs=logprobs, **extra))
            if meta["finish_reason"] is not None:
                if req.return_meta_info:
                    extra["meta_info"] = meta
                yield sse(chunk(index, {}, finish_reason_str(meta["finish_reason"]), **extra))
        if options and options.include_usage and metas:
            yield sse({
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_model_name,
                "choices": [], "usage": self.total_usage([metas[i] for i in sorted(metas)], req.n),
            })

    def chat_logprobs(self, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
        """The chat ``logprobs`` object: one {token, logprob, bytes, top_logprobs} per output token."""
        content = []
        for tok, lp, top in self.token_logprobs(meta, start):
            content.append({
                "token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top],
            })
        return {"content": content}


def _apply_chat_template_params(tokenizer: Any) -> frozenset[str]:
    """The named parameters of the tokenizer's apply_chat_template, except the conversation and the template."""
    method = getattr(tokenizer, "apply_chat_template", None)
    if method is None:
        return frozenset()
    params = inspect.signature(method).parameters.values()
    return frozenset(
        p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("conversation", "chat_template")
    )
