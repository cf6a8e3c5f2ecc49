"""vLLM's cache_config_info labels, from what the engine reported at start-up."""

from __future__ import annotations

from typing import Any


def cache_config_info(lim: Any, args: Any) -> dict[str, str]:
    """lim: the engine's EngineLimits; args: its EngineArgs."""
    size = lim.num_kv_blocks * lim.block_size
    return {"block_size": str(lim.block_size), "num_gpu_blocks": str(lim.num_kv_blocks),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(args.kv_cache_memory_bytes),
            "num_cpu_offload_gib": str(args.kv_offloading_size or 0),
            "kv_cache_size_tokens": str(size),
            "kv_cache_max_concurrency": f"{size / lim.max_model_len:.2f}"}
