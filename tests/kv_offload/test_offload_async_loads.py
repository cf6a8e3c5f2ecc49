"""Disk hits read in the background: the connector defers a request instead of blocking the
scheduler, shares reads between requests, drops what fails, lets go of abandoned requests;
the store persists its CPU tier at shutdown. No engine, no model."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from tier_fixtures import (
    LAYOUT,
    _assert_holds,
    _connector,
    _disk_of,
    _h,
    _payload,
    _request,
    _store,
)

from shoal.kv_offload import disk_tier
from shoal.kv_offload.disk_format import HEADER_BYTES
from shoal.kv_offload.disk_reader import DiskReader
from shoal.kv_offload.store import TieredKVStore


def _on_disk(store: TieredKVStore, blocks: range) -> None:
    for i in blocks:
        _disk_of(store).store([_h(i)], _payload(i))
    store.drain()


def _gate(store: TieredKVStore) -> tuple[threading.Event, list[bytes]]:
    """Holds every disk read until the event is set; records the hashes read."""
    gate, calls = threading.Event(), []
    read = _disk_of(store).read_into

    def gated(h, dst):
        calls.append(h)
        assert gate.wait(10)
        return read(h, dst)

    _disk_of(store).read_into = gated
    return gate, calls


def test_disk_hits_defer_the_request_until_read(tmp_path):
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=8)
    for i in (0, 1):  # CPU hits first, then disk
        store.cpu.store([_h(i)], _payload(i))
    _on_disk(store, range(2, 5))
    conn = _connector(store)
    gate, calls = _gate(store)
    req = _request("r", range(5))
    assert conn.stage(req, 0) is None  # returns at once; reads run in the background
    assert store.cpu.num_pinned() == 5  # its CPU hits and the slots being read are held
    conn.begin_step()
    assert conn.stage(req, 0) is None and conn.num_deferred == 1  # still reading
    gate.set()
    store.wait_loads()
    staged = conn.stage(req, 0)
    _assert_holds(store, staged, range(5))
    assert sorted(calls) == [_h(i) for i in range(2, 5)] and conn.num_deferred == 0
    cpu, disk = store.stats().tiers
    assert (cpu.queries, cpu.hits, disk.queries, disk.hits) == (5, 2, 3, 3)  # counted once
    assert disk.blocks_loaded == 3 and disk.bytes_loaded == 3 * LAYOUT.nbytes
    assert disk.load_seconds > 0
    assert store.cpu.num_pinned() == 5  # each staged block pinned once, until commit/cancel
    conn.cancel(staged)
    assert store.cpu.num_pinned() == 0
    store.check()
    store.close()


def test_cpu_hits_alone_are_staged_at_once(tmp_path):
    store = _store(tmp_path, cpu_blocks=4)
    store.cpu.store([_h(0), _h(1)], _payload(0, 2))
    conn = _connector(store)
    staged = conn.stage(_request("r", range(3)), 0)
    assert [b.key for b in staged] == [_h(0), _h(1)]
    conn.cancel(staged)
    store.check()
    store.close()


def test_device_hits_that_moved_while_reading_are_respected(tmp_path):
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=8)
    _on_disk(store, range(4))
    conn = _connector(store)
    req = _request("r", range(4))
    assert conn.stage(req, 0) is None
    store.wait_loads()
    staged = conn.stage(req, 2)  # blocks 0 and 1 were computed on the device meanwhile
    _assert_holds(store, staged, range(2, 4))
    assert store.cpu.num_pinned() == 2  # the pins on 0 and 1 went with the old staging
    conn.cancel(staged)
    store.check()
    store.close()


def test_two_requests_wanting_a_block_read_it_once(tmp_path):
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=8)
    _on_disk(store, range(3))
    conn = _connector(store)
    gate, calls = _gate(store)
    a, b = _request("a", range(3)), _request("b", range(2))
    assert conn.stage(a, 0) is None and conn.stage(b, 0) is None
    gate.set()
    store.wait_loads()
    staged_a, staged_b = conn.stage(a, 0), conn.stage(b, 0)
    assert sorted(calls) == [_h(0), _h(1), _h(2)]  # not 5 reads
    _assert_holds(store, staged_a, range(3))
    _assert_holds(store, staged_b, range(2))
    assert store.stats().tier("disk").blocks_loaded == 3
    conn.cancel(staged_a)
    conn.cancel(staged_b)
    assert store.cpu.num_pinned() == 0
    store.check()
    store.close()


def test_abandoned_request_lets_go_and_its_reads_land_unpinned(tmp_path):
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=8)
    store.cpu.store([_h(0)], _payload(0))
    _on_disk(store, range(1, 3))
    conn = _connector(store)
    gate, _ = _gate(store)
    assert conn.stage(_request("r", range(3)), 0) is None
    conn.abandon("r")
    conn.abandon("r")  # twice, or for a request never deferred: nothing happens
    conn.abandon("never-seen")
    assert store.cpu.num_pinned() == 2  # only the reads' own pins are left
    gate.set()
    conn.begin_step()  # settles whatever ended
    store.wait_loads()
    assert store.cpu.num_pinned() == 0 and conn.num_deferred == 0
    assert all(store.cpu.contains(_h(i)) for i in range(3))  # ordinary cached blocks now
    staged = conn.stage(_request("s", range(3)), 0)  # so a newcomer finds them in the CPU tier
    _assert_holds(store, staged, range(3))
    conn.cancel(staged)
    store.check()
    store.close()


@pytest.mark.parametrize("damage", ["flip", "vanish", "exception"])
def test_a_block_that_fails_in_the_background_ends_the_hit(tmp_path, monkeypatch, caplog, damage):
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=8)
    _on_disk(store, range(4))
    path = _disk_of(store).dir / (_h(2).hex() + ".kv")
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 10] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "vanish":
        path.unlink()
    else:
        read = disk_tier.read_block

        def failing(p, key, h, dst):
            if h == _h(2):
                raise RuntimeError("boom")
            read(p, key, h, dst)

        monkeypatch.setattr(disk_tier, "read_block", failing)
    conn = _connector(store)
    req = _request("r", range(4))
    with caplog.at_level(logging.WARNING, logger="shoal.kv_offload.disk_tier"):
        assert conn.stage(req, 0) is None
        store.wait_loads()
        staged = conn.stage(req, 0)
    _assert_holds(store, staged, range(2))  # never served: the request computes the rest
    assert not _disk_of(store).contains(_h(2)) and not store.cpu.contains(_h(2))
    assert store.stats().tier("disk").damaged == (damage == "flip")
    if damage == "exception":
        assert "RuntimeError: boom" in caplog.text
    conn.cancel(staged)
    assert store.cpu.num_pinned() == 0
    store.check()  # the file is gone too: index == files
    store.close()


def test_no_unpinned_cpu_room_stops_the_hit(tmp_path):
    store = _store(tmp_path, cpu_blocks=2, disk_blocks=8)
    _on_disk(store, range(4))
    conn = _connector(store)
    req = _request("r", range(4))
    assert conn.stage(req, 0) is None
    store.wait_loads()
    staged = conn.stage(req, 0)
    _assert_holds(store, staged, range(2))  # two slots: the hit stops there
    conn.cancel(staged)
    store.check()
    store.close()


def test_blocking_stage_when_deferral_is_off(tmp_path):
    store = _store(tmp_path, cpu_blocks=4, disk_blocks=4)
    _on_disk(store, range(3))
    conn = _connector(store)
    conn.defer_loads = False
    staged = conn.stage(_request("r", range(3)), 0)
    _assert_holds(store, staged, range(3))
    assert store.stats().tier("disk").queries == 3  # the wait does not count lookups again
    conn.cancel(staged)
    store.close()


def test_shutdown_waits_for_reads_in_flight(tmp_path):
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=8)
    _on_disk(store, range(3))
    conn = _connector(store)
    gate, _ = _gate(store)
    assert conn.stage(_request("r", range(3)), 0) is None
    collect = store.loads.collect
    in_flight_at_wait = []

    def collect_then_open(wait_all: bool = False) -> None:
        if wait_all and not gate.is_set():  # shutdown is about to wait: the reads still run
            in_flight_at_wait.append(len(store.loads))
            gate.set()
        collect(wait_all)

    store.loads.collect = collect_then_open
    store.shutdown()  # joins the reader threads once the reads end
    assert in_flight_at_wait == [3]
    assert not any(t.is_alive() for t in _disk_of(store).reader._pool._threads)
    assert len(store.loads) == 0
    store.shutdown()  # a second call does nothing


def test_shutdown_persists_the_cpu_tier(tmp_path):
    store = _store(tmp_path, cpu_blocks=4, disk_blocks=8, background=True)
    for i in range(3):
        store.cpu.store([_h(i)], _payload(i))
    store.cpu.pin(_h(2))  # pinned (a waiting request holds it): persisted all the same
    slot = store.reserve_for_device(_h(9))  # its device copy never ran: must not be kept
    store.cpu.pool[slot].fill_(-1)
    assert len(_disk_of(store)) == 0
    store.shutdown()
    again = _store(tmp_path, cpu_blocks=4, disk_blocks=8)
    assert sorted(_disk_of(again).keys()) == [_h(0), _h(1), _h(2)]
    slots = again.stage([_h(i) for i in range(3)])
    for i, s in enumerate(slots):
        assert torch.equal(again.cpu.pool[s], _payload(i)[0])
    again.unpin([_h(i) for i in range(3)])
    again.check()
    again.close()


def test_shutdown_at_interpreter_exit_still_persists(tmp_path):
    """atexit callbacks run after Python has shut its thread pools: writes go on inline."""
    store = _store(tmp_path, cpu_blocks=4, disk_blocks=8, background=True)
    for i in range(3):
        store.cpu.store([_h(i)], _payload(i))
    _disk_of(store).writer._pool.shutdown()  # what interpreter exit does to every pool
    store.shutdown()
    again = _store(tmp_path, cpu_blocks=4, disk_blocks=8)
    assert sorted(_disk_of(again).keys()) == [_h(0), _h(1), _h(2)]
    again.close()


def test_reader_time_is_wall_time_not_a_sum_over_threads():
    now = [10.0]
    reader = DiskReader(4, clock=lambda: now[0])
    all_running, release = threading.Barrier(5), threading.Event()

    def read() -> None:
        all_running.wait(10)
        assert release.wait(10)

    futures = [reader.submit(read) for _ in range(4)]  # four reads side by side
    all_running.wait(10)
    now[0] += 0.1
    release.set()
    for f in futures:
        f.result()
    assert reader.take_busy_seconds() == pytest.approx(0.1)  # not 0.4: bytes / s is bandwidth
    assert reader.take_busy_seconds() == 0.0
    now[0] += 5.0  # idle: not counted
    started, release = threading.Event(), threading.Event()

    def lone_read() -> None:
        started.set()
        assert release.wait(10)

    future = reader.submit(lone_read)
    assert started.wait(10)
    now[0] += 0.25
    release.set()
    future.result()
    assert reader.take_busy_seconds() == pytest.approx(0.25)
    reader.close()
