"""vLLM's development routes for engines inside training loops, on only with
VLLM_SERVER_DEV_MODE=1 (as vLLM; SHOAL_SERVER_DEV_MODE too): POST /sleep?level=1|2,
POST /wake_up[?tags=weights&tags=kv_cache], GET /is_sleeping, POST /reset_prefix_cache,
POST /pause[?wait_for_inflight_requests=&clear_cache=], POST /resume, GET /is_paused, and for
weight updates from a training loop POST /collective_rpc {"method", "args", "kwargs",
"timeout"} (vLLM's; only the lifecycle methods of shoal/worker/lifecycle.py RPC_METHODS:
{"results": one per rank}) and POST /update_weights_from_path {"path": folder or .gguf}
(needs an idle or paused engine; empties the prefix cache; answers the new weights_checksum)."""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from shoal import envs
from shoal.engine.async_llm import AsyncLLM
from shoal.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

def dev_mode() -> bool:
    return envs.switched_on(envs.SHOAL_SERVER_DEV_MODE, "VLLM_SERVER_DEV_MODE")


class CollectiveRpcRequest(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None  # seconds (default 600)


class UpdateWeightsRequest(BaseModel):
    path: str
    timeout: float | None = None


async def _call(coro: Any) -> Any:
    """An engine utility; its ValueError (a bad level or method, requests in flight) is the
    client's: 409 when the engine is busy, else 400."""
    try:
        return await coro
    except RuntimeError as e:
        text = str(e)
        if text.startswith("ValueError: "):
            text = text.removeprefix("ValueError: ")
            raise OpenAIError(409 if "needs an idle engine" in text else 400, text) from None
        raise


def add_dev_routes(app: FastAPI, engine: AsyncLLM) -> None:
    if not dev_mode():
        return
    logger.warning("development routes are on (VLLM_SERVER_DEV_MODE): /sleep, /wake_up, "
                   "/is_sleeping, /reset_prefix_cache, /pause, /resume, /is_paused, "
                   "/collective_rpc, /update_weights_from_path")
    _add_weight_routes(app, engine)

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if level not in (1, 2):
            raise OpenAIError(400, f"level must be 1 or 2 (got {level})", "level")
        await _call(engine.sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> Response:  # noqa: B008
        await _call(engine.wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.post("/pause")
    async def pause(wait_for_inflight_requests: bool = False,
                    clear_cache: bool = True) -> JSONResponse:
        """Returns once the live requests are aborted (or, waiting, have finished)."""
        await _call(engine.pause_generation(wait_for_inflight_requests=wait_for_inflight_requests,
                                            clear_cache=clear_cache))
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await _call(engine.resume_generation())
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await engine.is_paused()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await _call(engine.reset_prefix_cache()):
            raise OpenAIError(409, "requests still hold cached blocks; try again when idle")
        return Response(status_code=200)


def _add_weight_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> JSONResponse:
        results = await _call(engine.collective_rpc(body.method, body.args, body.kwargs,
                                                    timeout=body.timeout or 600.0))
        return JSONResponse({"results": results})

    @app.post("/update_weights_from_path")
    async def update_weights_from_path(body: UpdateWeightsRequest) -> JSONResponse:
        if not body.path or not os.path.exists(body.path):
            raise OpenAIError(400, f"no such checkpoint folder or file: {body.path!r}", "path")
        count = await _call(engine.update_weights_from_path(body.path,
                                                            timeout=body.timeout or 600.0))
        out: dict[str, Any] = {"status": "updated", "num_tensors": count}
        try:
            out["weights_checksum"] = await engine.collective_rpc("weights_checksum")
        except RuntimeError as e:  # (an engine without one: the update still landed)
            logger.warning("no weights checksum after the update: %s", e)
        return JSONResponse(out)
