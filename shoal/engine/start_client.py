"""Starting the frontend's engine: one core process, or data-parallel replicas behind one
client (the two client kinds live in core_client.py and dp_client.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from shoal.engine.core_client import EngineCoreClient
from shoal.engine.engine_args import EngineArgs


async def start_engine_client(engine_args: EngineArgs, log_level: int = logging.INFO,
                              build_core: Callable[[EngineArgs], Any] | None = None) -> Any:
    """Checks what the frontend itself refuses, then spawns the engine: one core process, or
    a DataParallelCoreClient over several replicas. The model loads while the caller goes on
    (`wait_ready()` waits for it)."""
    if engine_args.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be >= 0, or -1 for no limit "
                         f"(got {engine_args.max_logprobs})")
    if engine_args.data_parallel_size > 1:  # several replicas behind one frontend
        from shoal.engine.dp_client import DataParallelCoreClient

        return await DataParallelCoreClient.start(engine_args, log_level=log_level,
                                                  build_core=build_core)
    return await EngineCoreClient.start(engine_args, log_level=log_level, build_core=build_core)
