"""Engine configuration: one frozen dataclass per concern (engine.py), speculative decoding's
(speculative.py). Torch-free: the scheduler and the frontend read them."""

from shoal.config.engine import (
    EXECUTOR_BACKENDS,
    RAY_INSTALL_HINT,
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_device,
    ray_installed,
    require_ray,
    resolve_dtype,
)
from shoal.config.speculative import SpeculativeConfig

__all__ = ["EXECUTOR_BACKENDS", "RAY_INSTALL_HINT", "CacheConfig", "EngineConfig",
           "KVOffloadConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig",
           "SpeculativeConfig", "default_device", "ray_installed", "require_ray",
           "resolve_dtype"]
