"""The engine arguments' CacheConfig: the KV pool's block size, prefix caching and storage
dtype, with what a model's layers ask of them (a linear-attention hybrid's pages must hold a
recurrent state; its replays under speculative decoding rule out prefix caching)."""

from __future__ import annotations

import logging
from typing import Any

from shoal.config import CacheConfig, resolve_kv_cache_dtype
from shoal.models.registry import has_linear_attention

logger = logging.getLogger(__name__)


def cache_config(args: Any, hf_config: Any, runner: str, dtype: Any) -> CacheConfig:
    """args: the EngineArgs (their own values checked); dtype: the model's torch dtype."""
    return CacheConfig(block_size(args, hf_config, runner, dtype),
                       prefix_caching(args, hf_config), args.gpu_memory_utilization,
                       args.kv_cache_memory_bytes, args.num_gpu_blocks_override,
                       args.kv_cache_dtype,
                       cpu_offload_bytes=args.weight_offload_bytes(args.resolved_device()))


def prefix_caching(args: Any, hf_config: Any) -> bool:
    """On as configured, but off for linear-attention layers under speculative decoding: a
    verify step leaves states that its successor's replay completes (not yet kept as
    snapshots)."""
    if (args.enable_prefix_caching and args.speculative_config is not None
            and has_linear_attention(hf_config)):
        logger.info("prefix caching off: speculative decoding on a model with "
                    "linear-attention layers")
        return False
    return args.enable_prefix_caching


def block_size(args: Any, hf_config: Any, runner: str, dtype: Any) -> int:
    """The configured block size, raised for a model with linear-attention layers until an
    attention page holds one layer's recurrent state (they share the pool's pages; an FP8
    page has half the bytes of a bfloat16 one, the float32 state the same)."""
    if runner != "generate" or not has_linear_attention(hf_config):
        return args.block_size
    from shoal.models.registry import resolve_model_class

    cls = resolve_model_class(hf_config)
    page = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    need = cls.block_size_for(hf_config, page.itemsize, args.tensor_parallel_size)
    size = max(need, -(-args.block_size // 64) * 64)
    if size != args.block_size:
        logger.info("block_size %d -> %d: a page must hold a linear-attention layer's state",
                    args.block_size, size)
    return size
