"""The step hand-off of KV offloading, between a real scheduler and a stand-in for the model
runner: a plan travels out in SchedulerOutput.kv_transfers, and its CPU slots stay pinned
(and the slots it fills unwritten to disk) until ModelRunnerOutput.kv_transfers_done brings
its id back. With async scheduling two plans are in flight at once. No engine, no model."""

from __future__ import annotations

import pytest
from tier_fixtures import LAYOUT, _disk, _store

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.request import Request
from shoal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.scheduler import Scheduler
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_offload.store import TieredKVStore
from shoal.sampling_params import SamplingParams

BS = LAYOUT.block_size
A = list(range(17))  # 4 full blocks and one token


def _scheduler(tmp_path, num_blocks: int = 5) -> tuple[Scheduler, TieredKVStore]:
    cc = CacheConfig(block_size=BS)
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    store = _store(tmp_path, cpu_blocks=8, disk_blocks=16)
    return Scheduler(sc, cc, num_blocks, kv_store=store), store


def _add(sched: Scheduler, rid: str, prompt: list[int]) -> None:
    sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=1), frozenset(),
                              max_tokens=1))


def _results(out: SchedulerOutput, copies_done: bool = True) -> ModelRunnerOutput:
    """What the runner reports: a token per sampling row, and the plan done with its step."""
    res = ModelRunnerOutput(sampled_token_ids={it.serial: 7 for it in out.scheduled
                                               if it.sample})
    if copies_done and out.kv_transfers is not None:
        res.kv_transfers_done.append(out.kv_transfers.plan_id)
    return res


def _run(sched: Scheduler, rid: str, prompt: list[int]) -> SchedulerOutput:
    """One request of one token, start to end."""
    _add(sched, rid, prompt)
    out = sched.schedule()
    sched.update(out, _results(out))
    assert not sched.requests
    return out


def test_plan_slots_stay_pinned_until_the_runner_reports_the_copies_done(tmp_path):
    sched, store = _scheduler(tmp_path)
    _run(sched, "a", A)  # A's 4 full blocks stay cached on the device
    _add(sched, "b", list(range(100, 117)))  # takes every block: A's are evicted
    out = sched.schedule()
    plan = out.kv_transfers
    assert plan is not None and len(plan.stores) == 4 and not plan.loads
    hashes = hash_full_blocks(A, BS, [])
    assert all(store.cpu.contains(h) for h in hashes)
    assert store.cpu.num_pinned() == 4 and store._unfilled == set(hashes)
    sched.schedule()  # another step meanwhile (nothing to run): the copies are not done yet
    assert store.cpu.num_pinned() == 4
    sched.update(out, _results(out))
    assert store.cpu.num_pinned() == 0 and not store._unfilled
    out = _run(sched, "a-again", A)  # now a CPU-tier hit: loads, pinned until done too
    assert len(out.kv_transfers.loads) == 4 and store.cpu.num_pinned() == 0
    assert sched.offload.num_plans_in_flight == 0
    store.check()


def test_two_steps_in_flight_each_hold_their_own_plan(tmp_path):
    sched, store = _scheduler(tmp_path)
    _run(sched, "a", A)
    _add(sched, "x", list(range(100, 105)))  # two blocks: some of A's are evicted
    first = sched.schedule()
    _add(sched, "y", list(range(200, 205)))
    second = sched.schedule()  # async scheduling: before the first step's results
    p1, p2 = first.kv_transfers, second.kv_transfers
    assert p1 is not None and p2 is not None and p1.plan_id != p2.plan_id
    assert p1.stores and p2.stores
    assert store.cpu.num_pinned() == len(p1.stores) + len(p2.stores)
    sched.update(first, _results(first))  # read while the second step runs
    assert store.cpu.num_pinned() == len(p2.stores)
    sched.update(second, _results(second))
    assert store.cpu.num_pinned() == 0 and sched.offload.num_plans_in_flight == 0
    store.check()


@pytest.mark.parametrize("copies_done", [False, True])
def test_shutdown_writes_down_only_slots_whose_copies_completed(tmp_path, copies_done):
    """A stop between schedule() and the runner (SIGTERM, say): the plan's CPU slots hold
    garbage and must not reach the disk, where a restart would serve them."""
    sched, store = _scheduler(tmp_path)
    _run(sched, "a", A)
    _add(sched, "b", list(range(100, 117)))
    out = sched.schedule()
    for _, slot in out.kv_transfers.stores:
        store.cpu.pool[slot].fill_(float("nan"))  # what an uncopied slot may hold
    if copies_done:
        sched.update(out, _results(out))
    store.shutdown()
    on_disk = _disk(tmp_path, 16).keys()
    assert sorted(on_disk) == (sorted(hash_full_blocks(A, BS, [])) if copies_done else [])


def test_a_plan_waits_for_a_step_that_runs_something(tmp_path):
    sched, store = _scheduler(tmp_path)
    _run(sched, "a", A)
    conn, pool = sched.offload, sched.kv.pool
    block = next(b for b in pool.free_queue if b.block_hash is not None)
    conn.on_device_evict(block)
    pool.uncache_block(block)
    assert conn.take_plan(have_work=False) is None  # the runner is not called: kept pending
    assert store.cpu.num_pinned() == 1
    plan = conn.take_plan(have_work=True)
    assert plan is not None and len(plan.stores) == 1
    conn.transfers_done([plan.plan_id])
    assert store.cpu.num_pinned() == 0 and not store._unfilled


def test_a_plan_of_a_step_that_raised_leaves_nothing_behind(tmp_path):
    """fail_steps: a plan whose step raised is never reported done; the slots it was to fill
    are discarded (never served, never written down) and its pins go."""
    sched, store = _scheduler(tmp_path)
    _run(sched, "a", A)  # A's blocks are cached on the device
    _add(sched, "b", list(range(100, 117)))  # evicts them: stores in this step's plan
    out = sched.schedule()
    assert out.kv_transfers is not None and out.kv_transfers.stores
    filled = [h for h in hash_full_blocks(A, BS, []) if store.cpu.contains(h)]
    assert filled and store.cpu.num_pinned() == len(filled)
    errors, serials = sched.fail_steps([out], "RuntimeError: boom")
    assert [e.request_id for e in errors] == ["b"] and "boom" in errors[0].error
    assert store.cpu.num_pinned() == 0 and not any(store.cpu.contains(h) for h in filled)
    assert sched.offload.num_plans_in_flight == 0
    store.shutdown()
    assert len(_disk(tmp_path, 16)) == 0  # nothing half-copied reached the disk


def test_discarded_blocks_leave_every_tier_and_pinned_ones_when_unpinned(tmp_path):
    import torch

    store = _store(tmp_path, cpu_blocks=4, disk_blocks=8)
    hs = [bytes([i]) * 16 for i in range(3)]
    payload = torch.zeros((1, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    for h in hs:
        store.cpu.store([h], payload)
    store.flush()  # all three on disk only
    for h in hs[:2]:
        store.cpu.store([h], payload)  # and two of them in the CPU tier again
    store.cpu.pin(hs[1])
    store.discard(hs)
    assert not store.cpu.contains(hs[0]) and store.cpu.contains(hs[1])  # pinned: later
    assert not any(t.contains(h) for t in store.lower for h in hs)
    store.unpin([hs[1]])
    assert not store.cpu.contains(hs[1])
    store.check()
    store.close()
