"""POST /v1/chat/completions: messages -> chat template -> generate -> OpenAI chat objects."""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse, Response

from sglite.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglite.srt.entrypoints.openai.serving_base import OpenAIServingBase, abort_error_response, finish_reason_str, sse
from sglite.srt.entrypoints.openai.template_worker import TemplateRenderError, TemplateWorker
from sglite.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglite.srt.managers.tokenizer_manager import RequestValidationError, TokenizerManager


class OpenAIServingChat(OpenAIServingBase):
    """Chat completions, streaming or not."""

    request_model = ChatCompletionRequest
    prompt_param = "messages"

    def __init__(
        self, tokenizer_manager: TokenizerManager, served_model_name: str, model_aliases: tuple[str, ...] = (),
        *, template_worker: Optional[TemplateWorker] = None, max_prompt_chars: int = 1 << 20,
    ) -> None:
        super().__init__(tokenizer_manager, served_model_name, model_aliases)
        # Set only with --trust-request-chat-template: renders client-supplied templates, time-limited.
        self.template_worker = template_worker
        self.max_prompt_chars = max_prompt_chars
        # chat_template_kwargs keys that would steer apply_chat_template itself rather than the template.
        self.reserved_template_kwargs = _apply_chat_template_params(tokenizer_manager.tokenizer)

    def check_unsupported(self, req: ChatCompletionRequest) -> None:
        """Also reject top_logprobs, tools, structured output and untrusted or steering template options."""
        super().check_unsupported(req)
        if req.top_logprobs:
            raise RequestValidationError(
                "top_logprobs > 0 is not supported by this server; use logprobs=true with top_logprobs 0 or unset",
                "top_logprobs",
            )
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
        messages = []
        for i, m in enumerate(req.messages):
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
            messages.append(message)
        return messages

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
            bootstrap_host=req.bootstrap_host,
            bootstrap_port=req.bootstrap_port,
            bootstrap_room=req.bootstrap_room,
        )

    async def respond_full(self, req: ChatCompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> Response:
        """One chat.completion object."""
        final = None
        async for out in self.tm.generate_request(obj, tokenized):
            final = out
        assert final is not None, "generate_request ended without a final output"
        meta = final["meta_info"]
        failed = abort_error_response([meta])
        if failed is not None:
            return failed
        body: dict[str, Any] = {
            "id": self.new_id("chatcmpl"),
            "object": "chat.completion",
            "created": self.now(),
            "model": self.served_model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": final["text"]},
                "logprobs": self.chat_logprobs(meta) if req.logprobs else None,
                "finish_reason": finish_reason_str(meta["finish_reason"]),
                "matched_stop": meta["finish_reason"].get("matched"),
            }],
            "usage": self.usage(meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]),
        }
        if req.return_meta_info:
            body["meta_info"] = meta
        return JSONResponse(body)

    async def stream_chunks(self, req: ChatCompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> AsyncIterator[str]:
        """chat.completion.chunk events: role first, then content deltas, then finish (and usage)."""
        cid, created = self.new_id("chatcmpl"), self.now()

        def chunk(delta: dict[str, Any], finish: Any = None, logprobs: Any = None, **extra: Any) -> dict[str, Any]:
            return {
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra,
            }

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        yield sse(chunk({"role": "assistant", "content": ""}))
        meta = None
        logprobs_sent = 0  # output tokens whose logprobs went out in earlier chunks
        async for out in self.tm.generate_request(obj, tokenized):
            meta = out["meta_info"]
            if out["delta_text"]:
                logprobs = None
                if req.logprobs:
                    logprobs = self.chat_logprobs(meta, logprobs_sent)
                    logprobs_sent = len(meta.get("output_token_logprobs") or [])
                yield sse(chunk({"content": out["delta_text"]}, logprobs=logprobs))
            if meta["finish_reason"] is not None:
                extra = {"meta_info": meta} if req.return_meta_info else {}
                yield sse(chunk({}, finish_reason_str(meta["finish_reason"]), **extra))
        if include_usage and meta is not None:
            usage = self.usage(meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])
            yield sse({
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_model_name,
                "choices": [], "usage": usage,
            })

    def chat_logprobs(self, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
        """The chat ``logprobs`` object: one {token, logprob, bytes, top_logprobs} per output token."""
        return {"content": [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
            for tok, lp in self.token_logprobs(meta, start)
        ]}


def _apply_chat_template_params(tokenizer: Any) -> frozenset[str]:
    """The named parameters of the tokenizer's apply_chat_template, except the conversation and the template."""
    method = getattr(tokenizer, "apply_chat_template", None)
    if method is None:
        return frozenset()
    params = inspect.signature(method).parameters.values()
    return frozenset(
        p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("conversation", "chat_template")
    )
