"""DP+EP's lockstep rounds (shoal/engine/dp_lockstep.py, shoal/lora/shared_expert_slots.py) on
two gloo processes, no engine: a replica's long local work before a mid-step round (a slow
adapter read before the LoRA bid) outlasts the heartbeat's timeout without failing the round,
while the heartbeat itself still gives up on a replica that late. And a replica that cannot
read an adapter the shared table already holds fails only its own requests of it: the table
keeps the slot on every replica."""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HEARTBEAT_S = 1.0  # the heartbeat group's timeout here (SHOAL_DP_SYNC_TIMEOUT_S: 30)
LATE_S = 2.0  # replica 1's local work before a round


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica(rank: int, port: int, results: dict) -> None:
    from shoal.engine.dp_lockstep import DPLockstep, DPPeerLostError
    from shoal.lora.request import LoRARequest
    from shoal.lora.shared_expert_slots import SharedExpertSlots, slot_key

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(minutes=1))
    heartbeat = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=HEARTBEAT_S))
    mid_step = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=1))
    lock = DPLockstep(heartbeat, mid_step, rank, 2)
    out: dict = {"busy": lock.sync(rank == 0)}
    slots = SharedExpertSlots(2, 8, dist.group.WORLD, torch.device("cpu"))
    slots.agree_max = lock.agree_max
    if rank == 1:
        time.sleep(LATE_S)  # a big adapter read before the bid
    out["late_bid"] = slots.agree([None], {}).writes

    a = LoRARequest("a", 1, "/adapters/a", content_digest="d1")
    first = slots.agree([a, None], {})  # both replicas serve a: one new slot, written
    slots.confirm(first.writes, {})
    out["first_writes"] = [slot for slot, _ in first.writes]
    # replica 1 can no longer read a's files (its dense load failed); replica 0 still serves
    refused = {slot_key(a): "its files changed"} if rank == 1 else {}
    second = slots.agree([a, None], refused)
    slots.set_tokens([a, None], [2, 1])
    out["second"] = (second.writes, second.failed, slots.slot_of.get(slot_key(a)),
                     slots.token_slots[:3].tolist())
    # a new adapter replica 1 cannot read fails on both replicas and takes no slot
    b = LoRARequest("b", 2, "/adapters/b", content_digest="d2")
    third = slots.agree([b], {slot_key(b): "gone"} if rank == 1 else {})
    out["third"] = (third.writes, sorted(third.failed), slot_key(b) in slots.slot_of)

    if rank == 1:
        time.sleep(LATE_S)  # late to the heartbeat now
    try:
        lock.sync(True)
        out["late_heartbeat"] = "agreed"
    except DPPeerLostError:
        out["late_heartbeat"] = "lost"
    results[rank] = out
    os._exit(0)  # (a timed-out gloo group cannot be torn down cleanly)


def test_mid_step_rounds_wait_past_the_heartbeat_timeout():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_replica, args=(_free_port(), results), nprocs=2, join=True,
                           start_method="spawn")
        got = dict(results)
    assert set(got) == {0, 1}
    key = (1, "/adapters/a", "d1")
    for rank in (0, 1):
        out = got[rank]
        assert out["busy"] is True
        assert out["late_bid"] == []  # the bid waited LATE_S > HEARTBEAT_S and agreed
        assert out["first_writes"] == [0]
        writes, failed, slot, rows = out["second"]
        assert writes == [] and slot == 0  # kept in the table, no write, on both
        if rank == 1:  # only the refusing replica's requests fail, its tokens skip the slot
            assert list(failed) == [key] and "DP+EP replica 1" in failed[key]
            assert rows == [-1, -1, -1]
        else:
            assert failed == {} and rows == [0, 0, -1]
        assert out["third"] == ([], [(2, "/adapters/b", "d2")], False)
    assert "lost" in (got[0]["late_heartbeat"], got[1]["late_heartbeat"])
