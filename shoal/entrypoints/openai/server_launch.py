"""`shoal serve`'s entry: the engine process is spawned first, then the HTTP side is imported.

The frontend's imports (FastAPI, uvicorn, pydantic and the serving modules: ~0.6 s here) and
the engine's start-up (torch, the model) are independent; spawning the engine before those
imports lets them overlap, so the server is ready that much sooner. This module stays light
for that reason: nothing here imports the HTTP stack at module level.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from shoal.engine.core_client import EngineStartupError
from shoal.engine.engine_args import EngineArgs
from shoal.engine.start_client import start_engine_client
from shoal.entrypoints.openai.server_settings import ServerSettings

logger = logging.getLogger("shoal.entrypoints.openai.api_server")


async def start_then_serve(engine_args: EngineArgs, settings: ServerSettings) -> int:
    try:
        client = await start_engine_client(engine_args)
    except (EngineStartupError, OSError, ValueError) as e:
        logger.error("the engine failed to start: %s", e)
        print(f"shoal: the engine failed to start: {e}", file=sys.stderr)
        return 1
    try:
        from shoal.entrypoints.openai.api_server import serve
    except BaseException:
        await client.shutdown()
        raise
    return await serve(engine_args, settings, client=client)


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """`shoal serve`; returns the exit code. On asyncio's own event loop: uvloop was measured
    slower here (36 against 30 us of frontend CPU per streamed token, with pyzmq's asyncio
    sockets), so it is not used even where installed. --api-server-count N > 1: N API
    processes over one engine (api_server_pool.py)."""
    if settings.api_server_count > 1:
        from shoal.entrypoints.openai.api_server_pool import check_pool_settings, serve_pool

        check_pool_settings(engine_args, settings)  # before anything starts
        return asyncio.run(serve_pool(engine_args, settings))
    return asyncio.run(start_then_serve(engine_args, settings))
