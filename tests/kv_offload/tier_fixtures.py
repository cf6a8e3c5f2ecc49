"""Small tiers, payloads and requests shared by the tier-level tests (1 KiB blocks, 4 tokens
each)."""

from __future__ import annotations

import torch

from shoal.core.request import Request
from shoal.kv_cache.block_pool import BlockPool
from shoal.kv_offload.connector import KVOffloadConnector
from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.disk_format import HEADER_BYTES
from shoal.kv_offload.disk_tier import DiskTier
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.kv_offload.policy import make_policy
from shoal.kv_offload.store import TieredKVStore
from shoal.sampling_params import SamplingParams

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
    return TieredKVStore([_cpu(cpu_blocks), _disk(tmp_path, disk_blocks, background=background)])


def _disk_of(store: TieredKVStore) -> DiskTier:
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    return disk


BLOCK = LAYOUT.block_size


def _request(rid: str, blocks: range) -> Request:
    """A waiting request whose prompt covers `blocks` (by hash) plus one token to compute."""
    req = Request(rid, list(range(len(blocks) * BLOCK + 1)), SamplingParams(max_tokens=1),
                  frozenset(), max_tokens=1)
    req.block_hashes = [_h(i) for i in blocks]
    return req


def _connector(store: TieredKVStore) -> KVOffloadConnector:
    return KVOffloadConnector(store, BlockPool(8), BLOCK)


def _assert_holds(store: TieredKVStore, staged, blocks: range) -> None:
    assert [b.key for b in staged] == [_h(i) for i in blocks]
    assert staged.num_blocks == len(blocks)
    for b, i in zip(staged, blocks):
        assert torch.equal(store.cpu.pool[b.slot], _payload(i)[0])
