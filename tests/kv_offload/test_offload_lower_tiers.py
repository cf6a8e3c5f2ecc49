"""A store over more than two tiers: a third lower tier (in memory, memory_tier.py) is looked
up after the disk, its hits are read into the CPU tier like disk hits, and CPU evictions and
the shutdown write down to it too. No engine, no model."""

from __future__ import annotations

import pytest
import torch
from memory_tier import MemoryTier
from tier_fixtures import (
    LAYOUT,
    _assert_holds,
    _connector,
    _cpu,
    _disk,
    _disk_of,
    _h,
    _payload,
    _request,
)

from shoal.kv_offload.store import TieredKVStore


def _three_tiers(tmp_path, cpu_blocks: int = 8) -> tuple[TieredKVStore, MemoryTier]:
    memory = MemoryTier(LAYOUT, 16)
    return TieredKVStore([_cpu(cpu_blocks), _disk(tmp_path, 16), memory]), memory


def test_a_hit_in_a_third_tier_is_read_into_the_cpu_tier(tmp_path):
    store, memory = _three_tiers(tmp_path)
    store.cpu.store([_h(0)], _payload(0))
    _disk_of(store).store([_h(1)], _payload(1))
    for i in (2, 3):
        memory.store([_h(i)], _payload(i))
    conn = _connector(store)
    req = _request("r", range(5))  # block 4 is nowhere
    assert conn.stage(req, 0) is None  # disk and memory reads are under way
    store.collect()
    store.wait_loads()
    staged = conn.stage(req, 0)
    _assert_holds(store, staged, range(4))
    assert memory.reads == 2
    figures = {t.name: (t.queries, t.hits, t.blocks_loaded) for t in store.stats().tiers}
    assert figures == {"cpu": (5, 1, 0), "disk": (4, 1, 1), "memory": (3, 2, 2)}  # counted once
    conn.cancel(staged)
    assert store.cpu.num_pinned() == 0
    store.check()
    store.close()


def test_skipping_a_tier_reads_the_next_one_that_holds_the_block(tmp_path):
    store, memory = _three_tiers(tmp_path, cpu_blocks=1)
    store.cpu.store([_h(0)], _payload(0))
    store.cpu.store([_h(1)], _payload(1))  # evicts block 0 into both lower tiers
    assert _disk_of(store).contains(_h(0)) and memory.contains(_h(0))
    store.cpu.store([_h(2)], _payload(2))  # evicts block 1: the only CPU slot is free again
    slots = store.stage([_h(0)], skip=["disk"])
    assert len(slots) == 1 and torch.equal(store.cpu.pool[slots[0]], _payload(0)[0])
    assert memory.reads == 1 and store.stats().tier("disk").queries == 0
    store.unpin([_h(0)])
    store.check()
    store.close()


def test_shutdown_writes_the_cpu_tier_down_to_every_lower_tier(tmp_path):
    store, memory = _three_tiers(tmp_path)
    for i in range(3):
        store.cpu.store([_h(i)], _payload(i))
    store.shutdown()
    assert sorted(memory.keys()) == [_h(i) for i in range(3)]
    again = _disk(tmp_path, 16)
    assert sorted(again.keys()) == [_h(i) for i in range(3)]


def test_a_store_starts_with_its_cpu_tier(tmp_path):
    memory = MemoryTier(LAYOUT, 4)
    with pytest.raises(ValueError, match="CPU tier"):
        TieredKVStore([memory])
    with pytest.raises(ValueError, match="differ"):
        TieredKVStore([_cpu(2), memory, MemoryTier(LAYOUT, 4)])
