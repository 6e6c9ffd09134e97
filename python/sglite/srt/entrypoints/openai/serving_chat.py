"""POST /v1/chat/completions: messages -> chat template -> generate -> OpenAI chat objects."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response

from sglite.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglite.srt.entrypoints.openai.serving_base import OpenAIServingBase, abort_error_response, finish_reason_str, sse
from sglite.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglite.srt.managers.tokenizer_manager import RequestValidationError


class OpenAIServingChat(OpenAIServingBase):
    """Chat completions, streaming or not."""

    request_model = ChatCompletionRequest
    prompt_param = "messages"

    def check_unsupported(self, req: ChatCompletionRequest) -> None:
        """Also reject top_logprobs, tools and structured output, which are not implemented."""
        super().check_unsupported(req)
        if req.top_logprobs:
            raise RequestValidationError(
                "top_logprobs > 0 is not supported by this server; use logprobs=true with top_logprobs 0 or unset",
                "top_logprobs",
            )
        if req.tools:
            raise RequestValidationError("tools are not supported by this server", "tools")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise RequestValidationError("only response_format type 'text' is supported", "response_format")

    def convert(self, req: ChatCompletionRequest) -> GenerateReqInput:
        """Render the messages with the tokenizer's chat template."""
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
            messages.append({"role": m.role, "content": content})
        prompt = self.tm.apply_chat_template(messages, req.chat_template_kwargs)
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
