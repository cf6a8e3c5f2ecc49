"""Undoing a step that raised while the scheduler built it (a bug met on one request: the
scheduler ends that request and schedules the rest again, shoal/engine/scheduler.py)."""

from __future__ import annotations

from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import ScheduledRequest
from shoal.engine.admission import StepPlan
from shoal.engine.waiting_queue import WaitingQueue
from shoal.kv_cache.manager import KVCacheManager


def roll_back(step: StepPlan, built: dict[int, ScheduledRequest], running: list[Request],
              waiting: WaitingQueue, kv: KVCacheManager, by_serial: dict[int, Request]
              ) -> None:
    """The step's requests are scheduled again next time as if it never was: counters the
    built items moved go back, requests it admitted return to the front of the queue (the
    runner never heard of them). Blocks allocated for running requests stay theirs (the next
    step needs them)."""
    for req, _ in step.scheduled.values():
        item = built.get(req.serial)
        if item is None:
            continue
        req.num_computed_tokens = item.context_len
        if item.sample:
            req.num_pending_tokens -= 1
        req.state_replay = item.replay
    for new in reversed(step.new_requests):
        req = by_serial.get(new.serial)
        if req is None or req.status != RequestStatus.RUNNING:
            continue
        running.remove(req)
        kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        waiting.push_front(req)
