"""POST /v1/completions: prompt text or token ids (one or a batch) -> OpenAI text_completion objects."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response

from sglite.srt.entrypoints.openai.protocol import CompletionRequest
from sglite.srt.entrypoints.openai.serving_base import OpenAIServingBase, abort_error_response, finish_reason_str, sse
from sglite.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglite.srt.managers.tokenizer_manager import RequestValidationError


class OpenAIServingCompletion(OpenAIServingBase):
    """Text completions, streaming or not; a list of prompts gives one choice per prompt."""

    request_model = CompletionRequest

    def check_unsupported(self, req: CompletionRequest) -> None:
        """Also reject echo, top logprobs (logprobs > 0), suffix and best_of, which are not implemented."""
        super().check_unsupported(req)
        if req.echo:
            raise RequestValidationError("echo is not supported by this server", "echo")
        if req.logprobs is not None and req.logprobs > 0:
            raise RequestValidationError(
                "top logprobs (logprobs > 0) are not supported by this server; logprobs=0 returns the sampled "
                "tokens' logprobs",
                "logprobs",
            )
        if req.suffix:
            raise RequestValidationError("suffix is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != 1:
            raise RequestValidationError("only best_of=1 is supported", "best_of")

    def convert(self, req: CompletionRequest) -> GenerateReqInput:
        """Map prompt shapes: str | [str] | [int] | [[int]]."""
        p = req.prompt
        text: Any = None
        ids: Any = None
        if isinstance(p, str):
            text = p
        elif not p:
            raise RequestValidationError("prompt must not be empty", "prompt")
        elif isinstance(p[0], str):
            text = p[0] if len(p) == 1 else list(p)
        elif isinstance(p[0], int):
            ids = list(p)
        else:
            ids = p[0] if len(p) == 1 else [list(x) for x in p]
        sp = self.sampling_params(req, req.max_tokens)
        is_batch = isinstance(text, list) or (bool(ids) and isinstance(ids[0], list))
        return GenerateReqInput(
            text=text,
            input_ids=ids,
            sampling_params=sp,
            rid=req.rid,
            stream=req.stream,
            return_logprob=req.logprobs is not None,
            bootstrap_host=None if is_batch else req.bootstrap_host,
            bootstrap_port=None if is_batch else req.bootstrap_port,
            bootstrap_room=None if is_batch else req.bootstrap_room,
        )

    async def respond_full(self, req: CompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> Response:
        """One text_completion object with a choice per prompt."""
        finals = sorted([o async for o in self.tm.generate_request(obj, tokenized)], key=lambda o: o["index"])
        failed = abort_error_response([o["meta_info"] for o in finals])
        if failed is not None:
            return failed
        choices, metas = [], []
        for out in finals:
            meta = out["meta_info"]
            metas.append(meta)
            choices.append({
                "index": out["index"],
                "text": out["text"],
                "logprobs": self.completion_logprobs(meta) if req.logprobs is not None else None,
                "finish_reason": finish_reason_str(meta["finish_reason"]),
                "matched_stop": meta["finish_reason"].get("matched"),
            })
        body: dict[str, Any] = {
            "id": self.new_id("cmpl"),
            "object": "text_completion",
            "created": self.now(),
            "model": self.served_model_name,
            "choices": choices,
            "usage": self.usage(
                sum(m["prompt_tokens"] for m in metas),
                sum(m["completion_tokens"] for m in metas),
                sum(m["cached_tokens"] for m in metas),
            ),
        }
        if req.return_meta_info:
            body["meta_info"] = metas[0] if len(metas) == 1 else metas
        return JSONResponse(body)

    async def stream_chunks(self, req: CompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> AsyncIterator[str]:
        """text_completion chunks with deltas; finish chunks per prompt; usage last when asked."""
        cid, created = self.new_id("cmpl"), self.now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        metas: dict[int, dict[str, Any]] = {}
        # Per prompt: (output tokens whose logprobs went out already, text length of those tokens).
        logprobs_sent: dict[int, tuple[int, int]] = {}
        async for out in self.tm.generate_request(obj, tokenized):
            meta = out["meta_info"]
            metas[out["index"]] = meta
            finish = finish_reason_str(meta["finish_reason"])
            if out["delta_text"] or finish is not None:
                logprobs = None
                if req.logprobs is not None:
                    start, offset = logprobs_sent.get(out["index"], (0, 0))
                    logprobs = self.completion_logprobs(meta, start, offset)
                    offset += sum(len(tok) for tok in logprobs["tokens"])
                    logprobs_sent[out["index"]] = (len(meta.get("output_token_logprobs") or []), offset)
                body: dict[str, Any] = {
                    "id": cid, "object": "text_completion", "created": created, "model": self.served_model_name,
                    "choices": [{"index": out["index"], "text": out["delta_text"], "logprobs": logprobs, "finish_reason": finish}],
                }
                if finish is not None and req.return_meta_info:
                    body["meta_info"] = meta
                yield sse(body)
        if include_usage and metas:
            usage = self.usage(
                sum(m["prompt_tokens"] for m in metas.values()),
                sum(m["completion_tokens"] for m in metas.values()),
                sum(m["cached_tokens"] for m in metas.values()),
            )
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": self.served_model_name,
                       "choices": [], "usage": usage})

    def completion_logprobs(self, meta: dict[str, Any], start: int = 0, text_offset: int = 0) -> dict[str, Any]:
        """The legacy completions ``logprobs`` object (tokens, token_logprobs; no top logprobs).

        ``text_offset`` is where token ``start`` begins in the completion text (streams send pieces)."""
        pairs = self.token_logprobs(meta, start)
        offsets, pos = [], text_offset
        for tok, _ in pairs:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": [tok for tok, _ in pairs],
            "token_logprobs": [lp for _, lp in pairs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
