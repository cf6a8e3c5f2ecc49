"""Small tiers and payloads shared by the tier-level tests (1 KiB blocks, 4 tokens each)."""

from __future__ import annotations

import torch

from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.disk_format import HEADER_BYTES
from shoal.kv_offload.disk_tier import DiskTier
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.kv_offload.policy import make_policy
from shoal.kv_offload.store import TieredKVStore

LAYOUT = BlockLayout(num_layers=2, layer_shape=(2, 4, 2, 8), dtype=torch.float32)  # 1 KiB
KEY = StoreKey.of("/models/tiny#safetensors#abc", LAYOUT)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _payload(i: int, n: int = 1) -> torch.Tensor:
    return torch.arange(n * 2 * 2 * 64, dtype=torch.float32).view(n, 2, 2, 64) + 1000 * i


def _cpu(blocks: int, policy: str = "lru") -> CPUTier:
    return CPUTier(LAYOUT, blocks * LAYOUT.nbytes, make_policy(policy, blocks))


def _disk(path, blocks: int, key: StoreKey = KEY, layout: BlockLayout = LAYOUT,
          background: bool = False) -> DiskTier:
    size = blocks * (HEADER_BYTES + layout.nbytes)
    return DiskTier(path, key, layout, size, make_policy("lru", blocks), background_writes=background)


def _store(tmp_path, cpu_blocks: int = 2, disk_blocks: int = 4,
           background: bool = False) -> TieredKVStore:
    return TieredKVStore(_cpu(cpu_blocks), _disk(tmp_path, disk_blocks, background=background))
