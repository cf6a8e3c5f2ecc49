"""LoRA adapters on the server: --lora-modules at start-up, and vLLM's run-time routes
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM; SHOAL_ALLOW_RUNTIME_LORA_UPDATING too). With
--api-server-count N the run-time changes go through the pool's adapter table, so every API
process serves the same adapters (pool_adapters.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from shoal import envs
from shoal.engine.async_llm import AsyncLLM
from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.lora_modules_arg import parse_lora_modules
from shoal.entrypoints.openai.pool_adapters import AdapterRefresh, SharedAdapters
from shoal.entrypoints.openai.pool_state import member
from shoal.entrypoints.openai.serving_models import ServedModels

logger = logging.getLogger(__name__)



def load_startup_adapters(models: ServedModels, items: list[str] | None) -> None:
    """--lora-modules: each adapter checked now; a bad one stops the start with its reason."""
    for name, path, base in parse_lora_modules(items or []):
        try:
            models.load_lora(name, path, base)
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
        logger.info("serving LoRA adapter %s from %s", name, path)


def runtime_updates_allowed() -> bool:
    return envs.switched_on(envs.SHOAL_ALLOW_RUNTIME_LORA_UPDATING,
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


async def _body(raw: Request) -> dict[str, Any]:
    try:
        body = await raw.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return body


def add_lora_routes(app: FastAPI, models: ServedModels, engine: AsyncLLM) -> None:
    if not runtime_updates_allowed():
        return
    logger.warning("run-time LoRA updates are on (VLLM_ALLOW_RUNTIME_LORA_UPDATING): anyone "
                   "who can reach the API can load adapters from this host's files")
    pool = member()
    shared = None if pool is None else SharedAdapters(pool.shared.file, pool.shared.cells,
                                                      pool.shared.adapters_cell)
    if shared is not None:
        app.add_middleware(AdapterRefresh, adapters=shared, models=models)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> PlainTextResponse:
        body = await _body(raw)
        name, path, base = body.get("lora_name"), body.get("lora_path"), \
            body.get("base_model_name")
        if shared is None:
            lora = models.load_lora(name, path, base)
        else:
            lora = await shared.load(models, name, path, base)
        try:  # read by the engine now, so its first request does not wait for it
            await engine.add_lora(lora)
        except ValueError as e:  # (checked above already: the folder changed meanwhile)
            if shared is None:
                models.unload_lora(name)
            else:
                await shared.unload(models, name)
            raise OpenAIError(400, str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> PlainTextResponse:
        body = await _body(raw)
        name = body.get("lora_name")
        lora = models.unload_lora(name) if shared is None else \
            await shared.unload(models, name)
        await engine.remove_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed "
                                 "successfully.")
