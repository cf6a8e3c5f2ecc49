"""How many KV blocks the pool gets, from the memory settings and the bytes of one block
(worker/kv_cache_tensors.py), and zeroed host memory for a pool on the CPU."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from shoal.config import CacheConfig

logger = logging.getLogger(__name__)

# On the CPU the pool is carved from host RAM: 4 GiB (vLLM CPU's default KV space), but never
# more than a quarter of the memory the machine has.
CPU_DEFAULT_KV_BYTES = 4 << 30


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory that costs nothing until written: numpy's zeros is calloc,
    whose large blocks are fresh pages the kernel zeroes on first touch, where torch.zeros
    writes every byte up front (1 s per 2 GiB on a laptop core, before the first request)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = elem
    for d in shape:
        n *= d
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def kv_budget_bytes(cfg: CacheConfig, device: torch.device, non_kv_peak_bytes: int = 0) -> int:
    """The bytes the KV pool may take: kv_cache_memory_bytes, else the GPU's share left after
    the others and the activations' peak, else (CPU) a part of host memory."""
    if cfg.kv_cache_memory_bytes is not None:
        return cfg.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        return int(total * cfg.gpu_memory_utilization) - used_by_others - non_kv_peak_bytes
    return min(CPU_DEFAULT_KV_BYTES, _host_memory_bytes() // 4)


def decide_num_blocks(cfg: CacheConfig, per_block: int, device: torch.device,
                      non_kv_peak_bytes: int = 0) -> int:
    if cfg.num_gpu_blocks_override is not None:
        return cfg.num_gpu_blocks_override
    budget = kv_budget_bytes(cfg, device, non_kv_peak_bytes)
    num = budget // per_block
    if num < 2:
        raise ValueError(
            f"not enough memory for the KV cache: {budget} bytes give {num} blocks of {per_block} "
            "bytes; raise gpu_memory_utilization or kv_cache_memory_bytes"
        )
    return int(num)
