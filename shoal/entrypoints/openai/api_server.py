"""The OpenAI-compatible server: FastAPI app factory and the uvicorn lifecycle.

Lifecycle: the engine process starts (and must report READY) before the port opens. SIGTERM
closes the listening socket and lets in-flight requests finish until --shutdown-timeout; then
each request still running ends with an OpenAI error (a JSON 503, or for a stream an "abort"
finish, an error event and [DONE]) and the server exits 0. If the engine process dies,
in-flight requests fail, /health turns 503 and the server exits 1.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

import shoal
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.core_client import EngineStartupError
from shoal.engine.engine_args import EngineArgs
from shoal.entrypoints.openai.auth import ApiKeyMiddleware
from shoal.entrypoints.openai.dev_routes import add_dev_routes
from shoal.entrypoints.openai.errors import (
    ServerShuttingDown,
    install_error_handlers,
)
from shoal.entrypoints.openai.limits import RequestSizeLimitMiddleware
from shoal.entrypoints.openai.lora_routes import add_lora_routes, load_startup_adapters
from shoal.entrypoints.openai.middleware import (
    RequestIdMiddleware,
    RootPathMiddleware,
    ServerLoad,
    ServerLoadMiddleware,
)
from shoal.entrypoints.openai.pool_metrics import (
    ApiServerIdentity,
    PoolMember,
    RequestSeriesOnly,
    merged_registry,
)
from shoal.entrypoints.openai.responses_api import OpenAIServingResponses
from shoal.entrypoints.openai.routes import (
    add_generation_routes,
    add_model_and_tokenizer_routes,
    add_pooling_routes,
    add_probe_routes,
)
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_chat import OpenAIServingChat
from shoal.entrypoints.openai.serving_completion import OpenAIServingCompletion
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.serving_pooling import OpenAIServingPooling
from shoal.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from shoal.loader.resolve import DEFAULT_MODEL_NAME
from shoal.metrics import LoggingStatLogger, PrometheusStatLogger
from shoal.metrics.cache_info import cache_config_info

logger = logging.getLogger(__name__)

DEATH_GRACE_S = 2.0
# After the --shutdown-timeout deadline, how long the handlers get to write their errors.
ERROR_GRACE_S = 5.0


def freeze_startup_objects() -> None:
    """Moves everything allocated during start-up (modules, the tokenizer, the app) out of the
    garbage collector's reach: a full collection would otherwise walk all of it again and
    again while requests stream (tens of microseconds per token, measured)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def served_names(engine_args: EngineArgs, settings: ServerSettings) -> list[str]:
    return settings.served_model_name or [engine_args.model or DEFAULT_MODEL_NAME]


def build_app(engine: AsyncLLM, settings: ServerSettings,
              registry: CollectorRegistry | None = None, pool: PoolMember | None = None
              ) -> FastAPI:
    """`pool`: this is one of several API processes (--api-server-count): /metrics shows
    them all, and this one records its requests' series only."""
    names = served_names(engine.engine_args, settings)
    models = ServedModels(names, engine.engine_args.model, engine.max_model_len,
                          engine.limits.lora)
    if settings.lora_modules and engine.limits.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    load_startup_adapters(models, settings.lora_modules)
    registry = registry if registry is not None else CollectorRegistry()
    prometheus = PrometheusStatLogger(
        models.default, registry, prefixes=settings.metrics_prefixes,
        max_model_len=engine.max_model_len,
        cache_info=cache_config_info(engine.limits, engine.engine_args))
    if pool is not None:
        registry = merged_registry(pool.metrics_dir, settings.metrics_prefixes)
    engine.stat_loggers.append(prometheus if pool is None else RequestSeriesOnly(prometheus))

    # strict_content_type off: a JSON body is read as JSON even when a client (curl -d)
    # forgets the Content-Type header.
    app = FastAPI(title="shoal", version=shoal.__version__, strict_content_type=False)
    app.state.engine = engine
    app.state.models = models  # the gRPC control plane answers for the same names
    app.state.registry = registry
    app.state.draining = False
    install_error_handlers(app)
    load = ServerLoad()
    if settings.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if settings.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if settings.api_key:  # added late: it runs early
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.root_path:
        app.add_middleware(RootPathMiddleware, root_path=settings.root_path)
    # Added last, so it runs first: an oversized body or header never reaches a handler.
    app.add_middleware(RequestSizeLimitMiddleware,
                       max_body_bytes=engine.engine_args.max_request_body_bytes)
    if pool is not None:
        app.add_middleware(ApiServerIdentity, index=pool.index)
    completion = OpenAIServingCompletion(engine, models, settings)
    chat = OpenAIServingChat(engine, models, settings)
    responses = OpenAIServingResponses(engine, models, settings)
    tokenization = OpenAIServingTokenization(engine, models)

    add_probe_routes(app, engine, registry, settings, load)
    add_model_and_tokenizer_routes(app, models, tokenization, settings)
    add_generation_routes(app, completion, chat, responses)
    add_pooling_routes(app, OpenAIServingPooling(engine, models, settings))
    add_lora_routes(app, models, engine)
    add_dev_routes(app, engine)
    return app


async def start_grpc(engine: AsyncLLM, app: FastAPI, settings: ServerSettings) -> Any:
    """The gRPC control plane on --grpc-port, over the same engine (None when off); grpcio
    is imported only then."""
    if not settings.grpc_port:
        return None
    from shoal.entrypoints.grpc.server import start_grpc_server

    events = engine.engine_args.kv_events_settings()  # where the engine publishes its KV events
    return await start_grpc_server(engine, app.state.models, settings,
                                   lambda: app.state.draining,
                                   events.endpoint if events is not None else None)


class _Server(uvicorn.Server):
    """uvicorn's server, with a hook when it starts shutting down (the listening socket is
    closed by then)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Any):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


async def serve(engine_args: EngineArgs, settings: ServerSettings,
                build_core: Any = None, client: Any = None, *,
                sockets: list[socket.socket] | None = None, pool: PoolMember | None = None
                ) -> int:
    """Runs the server until SIGTERM/SIGINT (exit code 0) or the engine's death (1).
    `build_core` replaces the engine core, `client` is an engine started already (see
    AsyncLLM.from_engine_args). One API process of several (api_server_pool.py) listens on
    its `sockets` and is `pool`; the engine's log line is the supervisor's there."""
    if settings.api_server_count > 1 and pool is None:
        raise ValueError("serve() is one API process: see server_launch.run_server")
    try:
        engine = await AsyncLLM.from_engine_args(engine_args, build_core=build_core,
                                                 client=client)
    except (EngineStartupError, OSError, ValueError) as e:
        logger.error("the engine failed to start: %s", e)
        if pool is None:  # (else the supervisor says it, once)
            print(f"shoal: the engine failed to start: {e}", file=sys.stderr)
        return 1
    if pool is None and not engine_args.disable_log_stats:
        engine.stat_loggers.append(LoggingStatLogger())
    try:
        app = build_app(engine, settings, pool=pool)
        grpc_server = await start_grpc(engine, app, settings)
    except (ValueError, OSError) as e:  # a setting that does not fit (--lora-modules), a port
        await engine.shutdown()
        print(f"shoal: {e}", file=sys.stderr)
        return 1
    freeze_startup_objects()
    where: dict[str, Any] = ({"uds": settings.uds} if settings.uds
                             else {"host": settings.host, "port": settings.port})
    # root_path is the app's (FastAPI strips it when present), not uvicorn's (which would
    # prepend it to every path): with it, routes answer with and without the prefix.
    config = uvicorn.Config(app, **where,
                            log_level=settings.uvicorn_log_level,
                            access_log=not settings.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=settings.shutdown_timeout + ERROR_GRACE_S,  # type: ignore[arg-type]
                            lifespan="off")
    loop = asyncio.get_running_loop()

    def expire() -> None:
        if engine.num_unfinished_requests:
            logger.warning("shutdown timeout: ending %d request(s) still running",
                           engine.num_unfinished_requests)
        engine.abort_all(ServerShuttingDown(
            f"the server is shutting down and the request did not finish within "
            f"--shutdown-timeout ({settings.shutdown_timeout:g} s)"))

    def start_drain() -> None:
        app.state.draining = True
        if settings.shutdown_timeout <= 0:
            expire()
        else:
            loop.call_later(settings.shutdown_timeout, expire)

    server = _Server(config, start_drain)
    died = False

    def on_engine_death() -> None:
        nonlocal died
        died = True
        logger.error("the engine process died; the server shuts down in %.0f s", DEATH_GRACE_S)
        # In-flight requests have their errors already; /health answers 503 meanwhile, so a
        # load balancer sees why before the port closes.
        loop.call_later(DEATH_GRACE_S, setattr, server, "should_exit", True)

    engine.on_dead(on_engine_death)
    # uvicorn re-raises the signal it caught once serve() returns; with a no-op handler in
    # place that is harmless, so a SIGTERM drain ends with exit code 0 instead of -15.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve(sockets=sockets)
    finally:
        if grpc_server is not None:  # its streams drain as HTTP's do (expire() ends them)
            await grpc_server.stop(settings.shutdown_timeout + ERROR_GRACE_S)
        await engine.shutdown()
    if died:
        print("shoal: the engine process died", file=sys.stderr)
        return 1
    return 0

