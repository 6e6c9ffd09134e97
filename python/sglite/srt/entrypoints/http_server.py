"""The HTTP server: FastAPI app over the TokenizerManager, run by uvicorn.

Routes: OpenAI (/v1/chat/completions, /v1/completions, /v1/models, /v1/models/{id}), SGLang native
(/generate, /health, /health_generate, /ready, /version, /get_model_info | /model_info,
/get_server_info | /server_info, /tokenize | /v1/tokenize, /detokenize | /v1/detokenize,
/abort_request, /flush_cache), Prometheus /metrics and the OpenAPI schema /openapi.json (the body
routes declare their request models there). Every client error is a 400 with an OpenAI-style body
(FastAPI's 422 included; 413 / 408 for a body too large or too slow); a dead subprocess turns
/health into 503 and stops the server with a message naming the process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import signal
import sys
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIRequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import sglite
from sglite.srt.configs.gguf import resolved_load_format
from sglite.srt.entrypoints.engine import server_info
from sglite.srt.entrypoints.launcher import LaunchedRuntime, LaunchError, launch_subprocesses
from sglite.srt.entrypoints.metrics import ServerMetrics
from sglite.srt.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    error_body,
)
from sglite.srt.entrypoints.openai.serving_base import (
    abort_error_response,
    check_batch_size,
    error_response,
    read_request_model,
    run_until_disconnect,
    sse,
)
from sglite.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglite.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglite.srt.entrypoints.openai.template_worker import TemplateWorker
from sglite.srt.entrypoints.request_limits import (
    RequestBodyError,
    RequestBodyLimitMiddleware,
    RequestBodyLimits,
    body_error_response,
    default_max_request_body_bytes,
)
from sglite.srt.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from sglite.srt.managers.cpu_threads import limit_to_one_thread, pin_to_frontend_cpus
from sglite.srt.managers.io_struct import GenerateReqInput
from sglite.srt.managers.tokenizer_manager import EngineDeadError, RequestValidationError
from sglite.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Routes reachable without the API key (liveness probes and scrapers).
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
HEALTH_GENERATE_TIMEOUT_S = 20.0


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every route except PUBLIC_PATHS (and CORS preflight).

    Digests are compared with ``secrets.compare_digest`` so the check takes the same time whatever
    the key; pure ASGI so the disconnect signal of ``receive`` reaches the handlers untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        scheme, _, token = header.partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        if scheme == "Bearer" and secrets.compare_digest(given, self.key_digest):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body("invalid or missing API key (send 'Authorization: Bearer <key>')", err_type="AuthenticationError", code=401),
            status_code=401,
        )
        await response(scope, receive, send)


def create_app(runtime: LaunchedRuntime) -> FastAPI:
    """The FastAPI app for a launched runtime."""
    args = runtime.server_args
    tm = runtime.tokenizer_manager
    served_name = args.served_model_name or args.model_path or "default"
    max_body = args.max_request_body_bytes or default_max_request_body_bytes(tm.context_len)
    template_worker = TemplateWorker() if args.trust_request_chat_template else None
    chat = OpenAIServingChat(tm, served_name, template_worker=template_worker, max_prompt_chars=max_body)
    completions = OpenAIServingCompletion(tm, served_name)
    tokenization = OpenAIServingTokenization(tm)
    metrics = ServerMetrics(served_name) if args.enable_metrics else None
    if metrics is not None:
        tm.on_request_finished = metrics.observe_finished

    # No slash redirects: Starlette builds them from the Host header (an open redirect); `/route/` is a 404.
    app = FastAPI(title="sglite", docs_url=None, redoc_url=None, openapi_url="/openapi.json", redirect_slashes=False)
    app.state.runtime = runtime
    app.openapi = lambda: _openapi_with_request_models(app)

    # ---------------------------------------------------------------- error mapping (never 422)
    @app.exception_handler(FastAPIRequestValidationError)
    async def _on_validation(request: Request, exc: FastAPIRequestValidationError) -> JSONResponse:
        return error_response(f"invalid request: {exc.errors()[:3]}")

    @app.exception_handler(RequestValidationError)
    async def _on_bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(str(exc), param=exc.param)

    @app.exception_handler(RequestBodyError)
    async def _on_body(request: Request, exc: RequestBodyError) -> JSONResponse:
        return body_error_response(exc)

    @app.exception_handler(EngineDeadError)
    async def _on_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(str(exc), status=503, err_type="ServiceUnavailableError")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        return error_response(str(exc.detail), status=exc.status_code, err_type=err_type)

    @app.exception_handler(Exception)
    async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
        # A server bug, not a client error: logged with its traceback, answered in the OpenAI shape.
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", status=500, err_type="InternalServerError")

    # ---------------------------------------------------------------- OpenAI
    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await chat.handle(request)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def v1_completions(request: Request) -> Response:
        return await completions.handle(request)

    def model_card() -> dict[str, Any]:
        return {
            "id": served_name, "object": "model", "created": int(time.time()), "owned_by": "sglite",
            "root": args.model_path, "max_model_len": tm.context_len,
        }

    @app.get("/v1/models")
    async def v1_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def v1_model(model: str) -> JSONResponse:
        if model not in (served_name, args.model_path):
            return error_response(f"The model `{model}` does not exist.", param="model", status=404, err_type="NotFoundError")
        return JSONResponse(model_card())

    for prefix in ("", "/v1"):
        name = prefix.strip("/") or "native"
        app.add_api_route(prefix + "/tokenize", tokenization.tokenize, methods=["POST"],
                          openapi_extra=_json_body(TokenizeRequest), operation_id=f"tokenize_{name}")
        app.add_api_route(prefix + "/detokenize", tokenization.detokenize, methods=["POST"],
                          openapi_extra=_json_body(DetokenizeRequest), operation_id=f"detokenize_{name}")

    # ---------------------------------------------------------------- native
    @app.post("/generate", openapi_extra=_json_body(GenerateRequest))
    async def generate(request: Request) -> Response:
        parsed = await read_request_model(request, GenerateRequest)
        if isinstance(parsed, Response):
            return parsed
        obj = GenerateReqInput(**parsed.model_dump())
        try:
            check_batch_size(obj, "text" if obj.text is not None else "input_ids")
            tokenized = await tm.run_off_loop(tm.tokenize_request, obj)
        except RequestValidationError as e:
            return error_response(str(e), param=e.param)
        if obj.stream:
            return StreamingResponse(_native_stream(obj, tokenized), media_type="text/event-stream")

        async def full() -> Response:
            outs = sorted([o async for o in tm.generate_request(obj, tokenized)], key=lambda o: o["index"])
            failed = abort_error_response([o["meta_info"] for o in outs])
            if failed is not None:
                return failed
            public = [{"text": o["text"], "output_ids": o["output_ids"], "meta_info": o["meta_info"]} for o in outs]
            # A batch, or n > 1 choices of one prompt, answers a list (SGLang's shape).
            return JSONResponse(public if len(public) > 1 or obj.is_batch else public[0])

        return await run_until_disconnect(request, full())

    async def _native_stream(obj: GenerateReqInput, tokenized: list) -> AsyncIterator[str]:
        try:
            async for o in tm.generate_request(obj, tokenized):
                item = {"text": o["text"], "output_ids": o["output_ids"], "meta_info": o["meta_info"]}
                if obj.is_batch or len(tokenized) > 1:
                    item["index"] = o["index"]
                yield sse(item)
        except EngineDeadError as e:
            yield sse({"error": error_body(str(e), err_type="ServiceUnavailableError", code=503)})
        finally:
            for t in tokenized:
                if t.rid in tm.rid_to_state:
                    tm.abort_request(t.rid)
        yield sse("[DONE]")

    @app.get("/health")
    async def health() -> Response:
        reason = tm.dead_reason or tm.check_children()
        if reason is not None:
            return error_response(reason, status=503, err_type="ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0})

        async def probe() -> None:
            async for _ in tm.generate_request(obj):
                pass

        try:
            await asyncio.wait_for(probe(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(
                f"the one-token probe did not finish within {HEALTH_GENERATE_TIMEOUT_S:.0f} s",
                status=503, err_type="ServiceUnavailableError",
            )
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        # Up once the subprocesses answered at start-up; not ready (503) once one has died.
        reason = tm.dead_reason or tm.check_children()
        if reason is not None:
            return error_response(reason, status=503, err_type="ServiceUnavailableError")
        return JSONResponse({"status": "ready"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": sglite.__version__})

    def model_info() -> dict[str, Any]:
        # SGLang 0.5.23's keys, plus the draft and the context length.
        return {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "served_model_name": served_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": resolved_load_format(args.model_path, args.load_format),
            "reasoning_parser": None,
            "chat_template": args.chat_template,
            "context_length": tm.context_len,
            "vocab_size": tm.vocab_size,
            "speculative_algorithm": args.speculative_algorithm,
            "speculative_draft_model_path": args.speculative_draft_model_path,
        }

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(model_info())

    @app.get("/model_info")
    async def model_info_route() -> JSONResponse:
        return JSONResponse(model_info())

    async def _server_info() -> JSONResponse:
        state = await tm.get_internal_state()
        info = server_info(runtime, state)
        # sglang-router reads these top-level keys at registration (PD mode needs disaggregation_mode).
        info.update(tokenizer_path=args.tokenizer_path or args.model_path, is_generation=True)
        return JSONResponse(json.loads(json.dumps(info, default=str)))

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        return await _server_info()

    @app.get("/server_info")
    async def server_info_route() -> JSONResponse:
        return await _server_info()

    @app.post("/abort_request", openapi_extra=_json_body(AbortRequest))
    async def abort_request(request: Request) -> Response:
        parsed = await read_request_model(request, AbortRequest)
        if isinstance(parsed, Response):
            return parsed
        if parsed.abort_all:
            for rid in list(tm.rid_to_state):
                tm.abort_request(rid)
        elif parsed.rid:
            tm.abort_request(parsed.rid)
        else:
            return error_response("give 'rid' or 'abort_all': true", param="rid")
        return Response(status_code=200)

    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        if out.success:
            return JSONResponse({"success": True, "message": "Cache flushed."})
        return error_response(f"cache not flushed: {out.message}")

    for method in ("GET", "POST"):  # one route each, so the OpenAPI operation ids differ
        app.add_api_route("/flush_cache", flush_cache, methods=[method], operation_id=f"flush_cache_{method.lower()}")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            return error_response("metrics are off; start the server with --enable-metrics", status=404, err_type="NotFoundError")
        try:
            state = await tm.get_internal_state(timeout=5.0)
        except (TimeoutError, EngineDeadError) as e:
            logger.warning("metrics: no scheduler state (%s)", e)
            state = {}
        body, content_type = metrics.render(state, num_waiting_front_end=len(tm.rid_to_state))
        return Response(body, media_type=content_type)

    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    # Outermost: a body over the limit is refused before anything (the API key check included) reads it.
    app.add_middleware(RequestBodyLimitMiddleware, limits=RequestBodyLimits(max_body, args.request_body_timeout))
    return app


# Models whose JSON schemas /openapi.json carries (the routes read and validate bodies themselves).
REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, GenerateRequest, AbortRequest)


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra declaring model as a route's JSON request body."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi_with_request_models(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes plus the request models under components.schemas (built once)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_MODELS:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def describe_serving(args: ServerArgs) -> str:
    """One log line saying what is served."""
    spec = (
        f" with {args.speculative_algorithm} draft {args.speculative_draft_model_path}"
        if args.speculative_algorithm else " without speculative decoding"
    )
    return f"serving model {args.model_path}{spec} on http://{args.host}:{args.port}"


def launch_server(server_args: ServerArgs, *, scheduler_entry: Any = None) -> int:
    """Start the subprocesses and serve HTTP until stopped; the exit status (1 if a process died)."""
    import uvicorn

    try:
        runtime = launch_subprocesses(server_args, scheduler_entry=scheduler_entry)
    except LaunchError as e:
        logger.error("start-up failed: %s", e)
        return 1
    # After the spawns (they inherit this process's CPUs): the HTTP/tokenizer process leaves the cores to the
    # scheduler ranks, on the CPUs they leave over.
    pin_to_frontend_cpus(server_args)
    limit_to_one_thread()
    exit_status = 0
    try:
        app = create_app(runtime)
        config = uvicorn.Config(
            app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
            timeout_keep_alive=5, access_log=False,
        )
        server = uvicorn.Server(config)

        def on_dead(reason: str) -> None:
            nonlocal exit_status
            logger.error("shutting the server down: %s", reason)
            exit_status = 1
            server.should_exit = True

        async def serve() -> None:
            watcher = asyncio.create_task(runtime.tokenizer_manager.watch_children(on_dead))
            logger.info(describe_serving(server_args))
            try:
                await server.serve()
            finally:
                watcher.cancel()

        # uvicorn re-raises a captured SIGTERM after its shutdown; turning it into SystemExit lets the
        # `finally` below stop the subprocesses instead of leaving them to their parent watchdogs.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            asyncio.run(serve())
        except KeyboardInterrupt:  # Ctrl-C after uvicorn's graceful shutdown: not an error
            logger.info("interrupted; shutting down")
    finally:
        runtime.shutdown()
    return exit_status



def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)
