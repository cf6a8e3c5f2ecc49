"""The executor for a parallel config (see shoal/executor/__init__.py)."""

from __future__ import annotations

from shoal.config import EngineConfig
from shoal.core.executor import Executor
from shoal.executor.rank_runner import model_runner
from shoal.loader import LoadedModel


def build_model_executor(config: EngineConfig, loaded: LoadedModel) -> Executor:
    """A ModelRunner (the pooling runner for a pooling model) in this process (uni); a
    MultiprocExecutor (mp) or RayExecutor (ray) whose ranks each hold one. Each implements
    shoal.core.executor.Executor."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        return model_runner(config, loaded)
    if backend == "ray":  # imports ray only now (an optional dependency)
        from shoal.executor.ray_executor import RayExecutor

        return RayExecutor(config, loaded)
    from shoal.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, loaded)

