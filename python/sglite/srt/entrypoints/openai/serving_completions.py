"""POST /v1/completions: prompt text or token ids (one or a batch) -> OpenAI text_completion objects."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.responses import Response

from sglite.srt.entrypoints.openai.protocol import CompletionRequest
from sglite.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    finish_reason_str,
    sse,
)
from sglite.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglite.srt.managers.tokenizer_manager import RequestValidationError


class OpenAIServingCompletion(OpenAIServingBase):
    """Text completions, streaming or not; a list of prompts gives one choice per prompt."""

    request_model = CompletionRequest

    def check_unsupported(self, req: CompletionRequest) -> None:
        """Refuse suffix and best_of (unserved options are refused by the request model)."""
        super().check_unsupported(req)
        if req.suffix:
            raise RequestValidationError("suffix is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != 1:
            raise RequestValidationError("only best_of=1 is supported (use n for several choices)", "best_of")

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
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,  # echo: prompt logprobs too
            bootstrap_host=None if is_batch else req.bootstrap_host,
            bootstrap_port=None if is_batch else req.bootstrap_port,
            bootstrap_room=None if is_batch else req.bootstrap_room,
        )

    def echo_text(self, obj: GenerateReqInput, index: int, n: int) -> str:
        """The prompt of choice ``index`` as text (echo=true), decoded when it was sent as token ids."""
        prompt = index // n
        if obj.text is not None:
            return obj.text[prompt] if isinstance(obj.text, list) else obj.text
        ids = obj.input_ids[prompt] if obj.is_batch else obj.input_ids  # type: ignore[index]
        return self.tm.tokenizer.decode(ids)

    async def respond_full(self, req: CompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> Response:
        """One text_completion object: n choices per prompt, prompt-major."""
        return await self.full_response(req, obj, tokenized, "text_completion", "cmpl", lambda out: {
            "text": (self.echo_text(obj, out["index"], req.n) if req.echo else "") + out["text"],
            "logprobs": self.completion_logprobs(out["meta_info"], with_prompt=req.echo) if req.logprobs is not None else None,
        })

    async def stream_chunks(self, req: CompletionRequest, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput]) -> AsyncIterator[str]:
        """text_completion chunks with deltas (the echoed prompt first); finish chunks per choice; usage last."""
        cid, created = self.new_id("cmpl"), self.now()
        options = req.stream_options
        metas: dict[int, dict[str, Any]] = {}
        # Per choice: (output tokens whose logprobs went out already, text length of those tokens).
        logprobs_sent: dict[int, tuple[int, int]] = {}
        if req.echo:
            for index in range(len(tokenized)):
                yield sse({
                    "id": cid, "object": "text_completion", "created": created, "model": self.served_model_name,
                    "choices": [{"index": index, "text": self.echo_text(obj, index, req.n), "logprobs": None, "finish_reason": None}],
                })
        async for out in self.tm.generate_request(obj, tokenized):
            meta = out["meta_info"]
            metas[out["index"]] = meta
            finish = finish_reason_str(meta["finish_reason"])
            # The manager yields every step that produced tokens, even when its text is held back (a partial
            # UTF-8 byte, a possible stop string): each is a chunk, since clients time tokens by chunks (vLLM too).
            logprobs = None
            if req.logprobs is not None:
                first = out["index"] not in logprobs_sent
                start, offset = logprobs_sent.get(out["index"], (0, 0))
                logprobs = self.completion_logprobs(meta, start, offset, with_prompt=req.echo and first)
                offset += sum(len(tok) for tok in logprobs["tokens"])
                logprobs_sent[out["index"]] = (len(meta.get("output_token_logprobs") or []), offset)
            body: dict[str, Any] = {
                "id": cid, "object": "text_completion", "created": created, "model": self.served_model_name,
                "choices": [{"index": out["index"], "text": out["delta_text"], "logprobs": logprobs, "finish_reason": finish}],
            }
            if options and options.continuous_usage_stats:
                body["usage"] = self.meta_usage(meta)
            if finish is not None and req.return_meta_info:
                body["meta_info"] = meta
            yield sse(body)
        if options and options.include_usage and metas:
            usage = self.total_usage([metas[i] for i in sorted(metas)], req.n)
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": self.served_model_name,
                       "choices": [], "usage": usage})

    def completion_logprobs(
        self, meta: dict[str, Any], start: int = 0, text_offset: int = 0, with_prompt: bool = False
    ) -> dict[str, Any]:
        """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset).

        ``text_offset`` is where token ``start`` begins in the choice's text (streams send pieces);
        ``with_prompt`` (echo) puts the prompt tokens first, the first of them with a null logprob."""
        entries = self.token_logprobs(meta, start)
        if with_prompt:
            entries = self.token_logprobs(meta, 0, key="input") + entries
        offsets, pos = [], text_offset
        for tok, _, _ in entries:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": [tok for tok, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries] if any(top for _, _, top in entries) else None,
            "text_offset": offsets,
        }
