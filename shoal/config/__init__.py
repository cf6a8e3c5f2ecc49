"""Engine configuration: one frozen dataclass per concern (engine.py), speculative decoding's
(speculative.py). Torch-free: the scheduler and the frontend read them."""

from shoal.config.engine import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    RAY_INSTALL_HINT,
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    check_kv_cache_dtype,
    default_device,
    ray_installed,
    require_ray,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from shoal.config.speculative import SpeculativeConfig

__all__ = ["EXECUTOR_BACKENDS", "KV_CACHE_DTYPES", "RAY_INSTALL_HINT", "CacheConfig",
           "EngineConfig", "KVOffloadConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig",
           "SpeculativeConfig", "check_kv_cache_dtype", "default_device", "ray_installed",
           "require_ray", "resolve_dtype", "resolve_kv_cache_dtype"]
