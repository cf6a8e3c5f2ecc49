"""The executor for a parallel config (see shoal/executor/__init__.py)."""

from __future__ import annotations

from typing import Any

from shoal.config import EngineConfig
from shoal.loader import LoadedModel


def build_model_executor(config: EngineConfig, loaded: LoadedModel) -> Any:
    """A ModelRunner in this process (uni); a MultiprocExecutor (mp) or RayExecutor (ray),
    both with the runner's interface."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from shoal.worker.model_runner import ModelRunner

        return ModelRunner(config, loaded)
    if backend == "ray":  # imports ray only now (an optional dependency)
        from shoal.executor.ray_executor import RayExecutor

        return RayExecutor(config, loaded)
    from shoal.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, loaded)
