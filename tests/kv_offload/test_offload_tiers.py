"""CPU and disk tiers and the store that chains them, without an engine."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from tier_fixtures import KEY, LAYOUT, _cpu, _disk, _disk_of, _h, _payload, _store

from shoal.kv_offload.disk_format import HEADER_BYTES
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.kv_offload.store import TieredKVStore


def _put(store: TieredKVStore, i: int) -> None:
    store.cpu.store([_h(i)], _payload(i))


def _read(tier, i: int) -> torch.Tensor | None:
    out = torch.empty((1, *LAYOUT.block_shape))
    return out[0] if tier.load([_h(i)], out) == 1 else None


def test_cpu_tier_holds_its_size_and_evicts_lru():
    cpu = _cpu(3)
    evicted = []
    cpu.on_evict = lambda h, payload: evicted.append((h, payload.clone()))
    for i in range(5):
        assert cpu.store([_h(i)], _payload(i)) == 1
        assert cpu.used_bytes <= cpu.capacity_bytes and len(cpu) <= 3
    assert [h for h, _ in evicted] == [_h(0), _h(1)]
    assert torch.equal(evicted[0][1], _payload(0)[0])  # the hook sees the data before reuse
    assert torch.equal(_read(cpu, 4), _payload(4)[0])
    assert cpu.stats.usage == 1.0 and cpu.stats.evictions == 2
    cpu.check()


def test_pinned_cpu_blocks_are_never_evicted():
    cpu = _cpu(2)
    cpu.store([_h(0), _h(1)], _payload(0, 2))
    cpu.pin(_h(0))
    cpu.pin(_h(1))
    assert cpu.reserve(_h(2)) is None  # all pinned: no room, nothing lost
    cpu.unpin(_h(0))
    assert cpu.reserve(_h(2)) is not None and not cpu.contains(_h(0))
    with pytest.raises(RuntimeError):
        cpu.unpin(_h(0))
    cpu.unpin(_h(1))
    cpu.check()


def test_cpu_evictions_cascade_to_disk_and_lookups_span_tiers(tmp_path):
    store = _store(tmp_path, cpu_blocks=2, disk_blocks=4)
    for i in range(4):
        _put(store, i)
    assert len(store.cpu) == 2 and len(_disk_of(store)) == 2  # 0, 1 went down
    assert store.lookup([_h(i) for i in range(5)]) == 4  # disk prefix, CPU continuation
    assert store.lookup([_h(0), _h(1)], skip=["disk"]) == 0
    assert store.lookup([_h(2), _h(3)], skip=["cpu"]) == 0  # disk goes through the CPU tier
    slots = store.stage([_h(0), _h(1), _h(9)])  # staged from disk, pinned in the CPU tier
    assert len(slots) == 2 and store.cpu.num_pinned() == 2
    for i, slot in enumerate(slots):
        assert torch.equal(store.cpu.pool[slot], _payload(i)[0])
    store.unpin([_h(0), _h(1)])
    assert store.flush() == 2 and len(store.cpu) == 0  # everything ends up on disk
    assert len(_disk_of(store)) == 4
    store.check()


def test_disk_size_limit_holds(tmp_path):
    disk = _disk(tmp_path, 3)
    for i in range(10):
        disk.store([_h(i)], _payload(i))
        disk.check()  # index == files, bytes on disk <= limit
    assert sorted(disk.keys()) == [_h(7), _h(8), _h(9)]
    assert disk.stats.evictions == 7 and disk.stats.usage == 1.0


def test_background_writes_keep_order_limit_and_serve_pending_blocks(tmp_path):
    disk = _disk(tmp_path, 3, background=True)
    gate = threading.Event()
    disk.writer._submit(gate.wait)  # hold the writer thread back
    disk.store([_h(i) for i in range(5)], _payload(0, 5))  # 0 and 1 evicted while queued
    assert sorted(disk.keys()) == [_h(2), _h(3), _h(4)]
    assert not list(disk.dir.glob("*.kv"))  # nothing written yet...
    assert torch.equal(_read(disk, 3), _payload(0, 5)[3])  # ...yet served from memory
    disk.remove(_h(3))
    disk.store([_h(3)], _payload(9))  # deleted then stored again: order must hold
    gate.set()
    disk.check()  # drains; index == files, within the limit
    assert torch.equal(_read(disk, 3), _payload(9)[0])
    disk.writer.close()


def test_disk_tier_survives_a_restart_and_drops_leftovers(tmp_path):
    disk = _disk(tmp_path, 8)
    for i in range(3):
        disk.store([_h(i)], _payload(i))
    (disk.dir / "ab.kv.tmp-123").write_bytes(b"half")  # a write cut short by a crash
    (disk.dir / (_h(7).hex() + ".kv")).write_bytes(b"short")  # wrong size
    again = _disk(tmp_path, 8)
    assert sorted(again.keys()) == [_h(0), _h(1), _h(2)]
    assert torch.equal(_read(again, 1), _payload(1)[0])
    assert sorted(os.listdir(again.dir)) == sorted([_h(i).hex() + ".kv" for i in range(3)] + ["key.json"])
    smaller = _disk(tmp_path, 2)  # the size limit was lowered: oldest files go
    assert len(smaller) == 2
    smaller.check()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "wrong_key", "swap"])
def test_damaged_disk_blocks_are_dropped_not_served(tmp_path, damage):
    disk = _disk(tmp_path, 8)
    disk.store([_h(0), _h(1), _h(2)], _payload(0, 3))
    path = disk.dir / (_h(1).hex() + ".kv")
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[HEADER_BYTES + 100] ^= 0xFF
    elif damage == "flip_header":
        data[0] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "wrong_key":
        data[12] ^= 0x01  # inside the key digest
    else:  # another block's file under this block's name
        data = bytearray((disk.dir / (_h(2).hex() + ".kv")).read_bytes())
    path.write_bytes(bytes(data))
    out = torch.empty((3, *LAYOUT.block_shape))
    assert disk.load([_h(0), _h(1), _h(2)], out) == 1  # the run stops at the damaged block
    assert not path.exists() and not disk.contains(_h(1)) and disk.stats.damaged == 1
    disk.check()


def test_damaged_disk_block_is_a_miss_when_staged(tmp_path):
    store = _store(tmp_path, cpu_blocks=4, disk_blocks=4)
    _disk_of(store).store([_h(0), _h(1)], _payload(0, 2))
    path = _disk_of(store).dir / (_h(1).hex() + ".kv")
    path.write_bytes(path.read_bytes()[:-1])
    slots = store.stage([_h(0), _h(1)])
    assert len(slots) == 1 and not store.cpu.contains(_h(1))  # the bad slot was given back
    store.unpin([_h(0)])
    store.check()


def test_other_keys_use_other_directories(tmp_path):
    a = _disk(tmp_path, 4)
    a.store([_h(0)], _payload(0))
    variants = [
        StoreKey.of("/models/other#safetensors#abc", LAYOUT),
        StoreKey.of(KEY.model_id, BlockLayout(2, (2, 4, 2, 8), torch.bfloat16)),
        StoreKey.of(KEY.model_id, BlockLayout(2, (2, 8, 2, 4), torch.float32)),
        StoreKey.of(KEY.model_id, BlockLayout(3, (2, 4, 2, 8), torch.float32)),
    ]
    dirs = {a.dir}
    for key in variants:
        layout = BlockLayout(key.num_layers, key.layer_shape, getattr(torch, key.dtype))
        other = _disk(tmp_path, 4, key, layout)
        assert not other.contains(_h(0))
        dirs.add(other.dir)
    assert len(dirs) == 5
    # A file moved into another key's directory is rejected by its header.
    other = _disk(tmp_path, 4, variants[0])
    os.replace(a.dir / (_h(0).hex() + ".kv"), other.dir / (_h(0).hex() + ".kv"))
    other = _disk(tmp_path, 4, variants[0])
    assert other.contains(_h(0)) and _read(other, 0) is None and other.stats.damaged == 1


def test_arc_tier_keeps_reused_blocks_through_a_scan():
    cpu = _cpu(4, "arc")
    cpu.store([_h(0), _h(1)], _payload(0, 2))
    for i in (0, 1):
        cpu.touch(_h(i))
    for i in range(10, 30):  # one-off blocks
        cpu.store([_h(i)], _payload(i))
    assert cpu.contains(_h(0)) and cpu.contains(_h(1))
    cpu.check()
