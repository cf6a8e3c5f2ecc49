"""How many KV blocks the pool gets, from the memory settings and the model's shape."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from shoal.config import CacheConfig
from shoal.worker.host_pages import populate

logger = logging.getLogger(__name__)

# On the CPU the pool is carved from host RAM: 4 GiB (vLLM CPU's default KV space), but never
# more than a quarter of the memory the machine has.
CPU_DEFAULT_KV_BYTES = 4 << 30


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, planes: int = 2) -> int:
    """planes: 2 for a K and a V plane per layer, 1 for latent attention (MLA)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return planes * num_layers * block_size * num_kv_heads * head_dim * elem


def layers_bytes_per_block(layers: list, block_size: int, dtype: torch.dtype) -> int:
    """One block of every paged attention layer (Attention or LatentAttention: each says its
    kv_planes, num_kv_heads and head_dim, the width of one cached row)."""
    a = layers[0]
    return bytes_per_block(len(layers), a.num_kv_heads, a.head_dim, block_size, dtype,
                           a.kv_planes)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory that costs nothing until written: numpy's zeros is calloc,
    whose large blocks are fresh pages the kernel zeroes on first touch, where torch.zeros
    writes every byte up front (1 s per 2 GiB on a laptop core, before the first request)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = elem
    for d in shape:
        n *= d
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


def allocate_kv_caches(layers: list, num_slots: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [planes, num_slots, Hk, D] cache per layer (views of one allocation), bound
    to the layers."""
    a = layers[0]
    shape = (len(layers), a.kv_planes, num_slots, a.num_kv_heads, a.head_dim)
    if device.type == "cpu":
        cache = zeroed_host_tensor(shape, dtype)
        populate(cache, planes=shape[0] * shape[1])  # huge pages (host_pages.py)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    caches = list(cache.unbind(0))
    for layer, kv in zip(layers, caches):
        layer.kv_cache = kv
    return caches


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def decide_num_blocks(cfg: CacheConfig, per_block: int, device: torch.device,
                      non_kv_peak_bytes: int = 0) -> int:
    if cfg.num_gpu_blocks_override is not None:
        return cfg.num_gpu_blocks_override
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used_by_others - non_kv_peak_bytes
    else:
        budget = min(CPU_DEFAULT_KV_BYTES, _host_memory_bytes() // 4)
    num = budget // per_block
    if num < 2:
        raise ValueError(
            f"not enough memory for the KV cache: {budget} bytes give {num} blocks of {per_block} "
            "bytes; raise gpu_memory_utilization or kv_cache_memory_bytes"
        )
    return int(num)
