"""Whole-cache moves between steps: push the device prefix cache into the tiers (benchmarks,
tests, and before a shutdown so a restart finds the blocks on disk)."""

from __future__ import annotations

from typing import Any


def offload_device_prefix_cache(core: Any) -> int:
    """Copies every cached device block that no request holds into the CPU tier and drops it
    from the device prefix cache; returns how many blocks were offered. Runs between steps
    (the engine core's thread), in batches that fit the CPU tier's unpinned room, so earlier
    batches cascade to disk instead of being lost."""
    sched, runner = core.scheduler, core.runner
    conn, pool = sched.offload, sched.kv.pool
    if conn is None:
        return 0
    victims = [b for b in pool.free_queue if b.block_hash is not None]
    batch = max(1, conn.store.cpu.capacity_blocks)
    for i in range(0, len(victims), batch):
        conn.begin_step()
        for block in victims[i:i + batch]:
            conn.on_device_evict(block)
            pool.uncache_block(block)
        plan = conn.take_plan(have_work=True)
        if plan:
            runner.kv_transfer.run(plan)
    conn.begin_step()  # waits for the copies and unpins
    return len(victims)


def persist(core: Any) -> None:
    """Device and CPU-tier blocks down to disk, e.g. before shutting the engine down (the
    store's shutdown() then has the CPU tier's leftovers to write)."""
    if core.kv_offload is None:
        return
    offload_device_prefix_cache(core)
    core.kv_offload.flush()
