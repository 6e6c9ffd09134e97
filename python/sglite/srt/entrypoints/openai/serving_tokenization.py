"""POST /tokenize and /detokenize (and their /v1/ twins), in SGLang 0.5.23's request and response shapes."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sglite.srt.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from sglite.srt.entrypoints.openai.serving_base import error_response, read_request_model
from sglite.srt.entrypoints.openai.serving_chat import text_messages
from sglite.srt.managers.tokenizer_manager import RequestValidationError, TokenizerManager


class OpenAIServingTokenization:
    """Text or chat messages -> token ids, and token ids -> text, with the server's tokenizer."""

    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    async def tokenize(self, request: Request) -> Response:
        """``{"tokens", "count", "max_model_len"}``; a list of prompts gives lists of tokens and counts."""
        req = await read_request_model(request, TokenizeRequest)
        if isinstance(req, Response):
            return req
        try:
            tokens = await self.tm.run_off_loop(self._encode, req)  # large prompts must not stall the loop
        except RequestValidationError as e:
            return error_response(str(e), param=e.param)
        count = [len(t) for t in tokens] if isinstance(req.prompt, list) else len(tokens)
        return JSONResponse({"tokens": tokens, "count": count, "max_model_len": self.tm.context_len})

    def _encode(self, req: TokenizeRequest) -> Any:
        tok = self.tm.tokenizer
        if req.messages is not None:
            prompt = self.tm.apply_chat_template(text_messages(req.messages), add_generation_prompt=req.add_generation_prompt)
            return tok.encode(prompt, add_special_tokens=False)  # the template places the special tokens itself
        if isinstance(req.prompt, list):
            return [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt]
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    async def detokenize(self, request: Request) -> Response:
        """``{"text"}`` of token ids inside the vocabulary."""
        req = await read_request_model(request, DetokenizeRequest)
        if isinstance(req, Response):
            return req
        bad = [t for t in req.tokens if not 0 <= t < self.tm.vocab_size]
        if bad:
            return error_response(f"tokens contains id {bad[0]} outside the vocabulary [0, {self.tm.vocab_size})", param="tokens")
        return JSONResponse({"text": self.tm.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)})
