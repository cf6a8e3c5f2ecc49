"""Whole-cache moves between steps: push the device prefix cache into the tiers (benchmarks,
tests, and before a shutdown so a restart finds the blocks on disk).

These run outside the step loop, with no step in flight, so they run their copies through
the engine core's KV transfer directly and wait for them."""

from __future__ import annotations

from typing import Any


def offload_device_prefix_cache(core: Any) -> int:
    """Copies every cached device block that no request holds into the CPU tier and drops it
    from the device prefix cache; returns how many blocks were offered. Runs between steps
    (the engine core's thread), in batches that fit the CPU tier's unpinned room, so earlier
    batches cascade to the lower tiers instead of being lost."""
    sched, transfer = core.scheduler, core.kv_transfer
    conn, pool = sched.offload, sched.kv.pool
    if conn is None:
        return 0
    victims = [b for queue in pool.free_queues for b in queue if b.block_hash is not None]
    batch = max(1, conn.store.cpu.capacity_blocks)
    for i in range(0, len(victims), batch):
        conn.begin_step()
        for block in victims[i:i + batch]:
            conn.on_device_evict(block)
            pool.uncache_block(block)
        plan = conn.take_plan(have_work=True)
        if plan:
            transfer.run(plan)
            transfer.wait(plan.plan_id)
            conn.transfers_done([plan.plan_id])  # unpinned: the next batch may evict them
    return len(victims)


def persist(core: Any) -> None:
    """Device and CPU-tier blocks down to the lower tiers, e.g. before shutting the engine
    down (the store's shutdown() then has the CPU tier's leftovers to write)."""
    if core.kv_offload is None:
        return
    offload_device_prefix_cache(core)
    core.kv_offload.flush()
