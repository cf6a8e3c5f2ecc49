"""The OpenAI-compatible server: FastAPI app factory and the uvicorn lifecycle.

Lifecycle: the engine process starts (and must report READY) before the port opens. SIGTERM
stops intake and lets in-flight requests finish, bounded by --shutdown-timeout, then exits 0.
If the engine process dies, in-flight requests fail, /health turns 503 and the server exits 1.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import shoal
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.core_client import EngineStartupError
from shoal.engine.engine_args import EngineArgs
from shoal.entrypoints.openai.auth import ApiKeyMiddleware
from shoal.entrypoints.openai.errors import error_response, install_error_handlers
from shoal.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIBaseModel,
    TokenizeRequest,
)
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_chat import OpenAIServingChat
from shoal.entrypoints.openai.serving_completion import OpenAIServingCompletion
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from shoal.loader.resolve import DEFAULT_MODEL_NAME
from shoal.metrics import LoggingStatLogger, PrometheusStatLogger

logger = logging.getLogger(__name__)

DEATH_GRACE_S = 2.0


def freeze_startup_objects() -> None:
    """Moves everything allocated during start-up (modules, the tokenizer, the app) out of the
    garbage collector's reach: a full collection would otherwise walk all of it again and
    again while requests stream (tens of microseconds per token, measured)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def _warn_unknown(req: OpenAIBaseModel) -> None:
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))


def build_app(engine: AsyncLLM, settings: ServerSettings,
              registry: CollectorRegistry | None = None) -> FastAPI:
    names = settings.served_model_name or [engine.engine_args.model or DEFAULT_MODEL_NAME]
    models = ServedModels(names, engine.engine_args.model, engine.max_model_len)
    registry = registry if registry is not None else CollectorRegistry()
    engine.stat_loggers.append(PrometheusStatLogger(models.default, registry))

    # strict_content_type off: a JSON body is read as JSON even when a client (curl -d)
    # forgets the Content-Type header.
    app = FastAPI(title="shoal", version=shoal.__version__, strict_content_type=False)
    app.state.engine = engine
    app.state.registry = registry
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    completion = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models)
    tokenization = OpenAIServingTokenization(engine, models)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, "the engine process is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": shoal.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.list().model_dump())

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        _warn_unknown(req)
        return JSONResponse(tokenization.tokenize(req).model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        _warn_unknown(req)
        return JSONResponse(tokenization.detokenize(req).model_dump())

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        _warn_unknown(req)
        return await completion.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        _warn_unknown(req)
        return await chat.create(req, raw)

    return app


async def serve(engine_args: EngineArgs, settings: ServerSettings,
                build_core: Any = None) -> int:
    """Runs the server until SIGTERM/SIGINT (exit code 0) or the engine's death (1).
    `build_core` replaces the engine core (see AsyncLLM.from_engine_args)."""
    try:
        engine = await AsyncLLM.from_engine_args(engine_args, build_core=build_core)
    except (EngineStartupError, OSError, ValueError) as e:
        logger.error("the engine failed to start: %s", e)
        print(f"shoal: the engine failed to start: {e}", file=sys.stderr)
        return 1
    engine.stat_loggers.append(LoggingStatLogger())
    app = build_app(engine, settings)
    freeze_startup_objects()
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.uvicorn_log_level,
                            access_log=not settings.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=settings.shutdown_timeout,  # type: ignore[arg-type]
                            lifespan="off")
    server = uvicorn.Server(config)
    died = False

    def on_engine_death() -> None:
        nonlocal died
        died = True
        logger.error("the engine process died; the server shuts down in %.0f s", DEATH_GRACE_S)
        # In-flight requests have their errors already; /health answers 503 meanwhile, so a
        # load balancer sees why before the port closes.
        asyncio.get_running_loop().call_later(DEATH_GRACE_S, setattr, server, "should_exit",
                                              True)

    engine.on_dead(on_engine_death)
    # uvicorn re-raises the signal it caught once serve() returns; with a no-op handler in
    # place that is harmless, so a SIGTERM drain ends with exit code 0 instead of -15.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve()
    finally:
        await engine.shutdown()
    if died:
        print("shoal: the engine process died", file=sys.stderr)
        return 1
    return 0


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """`shoal serve`; returns the exit code. On asyncio's own event loop: uvloop was measured
    slower here (36 against 30 us of frontend CPU per streamed token, with pyzmq's asyncio
    sockets), so it is not used even where installed."""
    return asyncio.run(serve(engine_args, settings))
