"""Executors: what runs the model for the engine core, on one device or several.

`build_model_executor` picks one from the parallel config: the plain `ModelRunner` in this
process for one device, `MultiprocExecutor` (shoal/executor/multiproc.py) for tensor
parallelism over worker processes on this host, `RayExecutor` (shoal/executor/ray_executor.py,
Ray an optional dependency) for worker ranks as Ray actors, on this host or several; each
rank of a pooling model is a PoolingModelRunner instead (shoal/executor/rank_runner.py).
Each implements shoal.core.executor.Executor (execute, sample, finish, ...), so EngineCore
does not know which one it holds."""

from shoal.executor.build import build_model_executor

__all__ = ["build_model_executor"]
