"""Scheduler with pipeline micro-batches (micro_batches > 1): up to that many steps in flight,
driven here as EngineCore's batch queue drives them, over the fake runner of
test_scheduler.py, which checks every cached position a step reads (steps run in order, as
every pipeline stage runs them). No request samples in two steps in flight, no step carries a
pending token, the steps are balanced, and preemption under a small pool changes nothing."""

from __future__ import annotations

import random
from collections import deque

import pytest
from engine.test_scheduler import (
    FakeRunner,
    assert_all_blocks_free,
    make_req,
    make_scheduler,
    prompt_of,
)

from shoal.core.scheduler_output import PENDING_TOKEN, SchedulerOutput
from shoal.engine.scheduler import Scheduler


def micro_batched(sched: Scheduler, depth: int) -> Scheduler:
    sched.micro_batches = depth
    return sched


def run_batch_queue(sched: Scheduler, runner: FakeRunner, depth: int
                    ) -> tuple[dict[str, list[int]], list[SchedulerOutput], int]:
    """Runs to completion with up to `depth` steps in flight; returns each request's tokens,
    the launched steps and the most steps seen in flight at once."""
    tokens: dict[str, list[int]] = {}
    inflight: deque[SchedulerOutput] = deque()
    launched: list[SchedulerOutput] = []
    most = 0
    for _ in range(5000):
        if not sched.has_unfinished_requests() and not inflight:
            return tokens, launched, most
        if len(inflight) < depth:
            out = sched.schedule()
            if not out.is_empty:
                busy = {it.serial for s in inflight for it in s.scheduled if it.sample}
                assert not busy & {it.serial for it in out.scheduled}
                assert all(PENDING_TOKEN not in it.input_token_ids for it in out.scheduled)
                inflight.append(out)
                launched.append(out)
                most = max(most, len(inflight))
                if len(inflight) < depth:
                    continue
        if inflight:
            step = inflight.popleft()
            for o in sched.update(step, runner.execute(step)):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            runner.remove_requests(sched.take_finished_serials())
    raise AssertionError("did not finish")


def test_two_micro_batches_split_the_requests_evenly() -> None:
    sched = micro_batched(make_scheduler(budget=256), 2)
    runner = FakeRunner(sched)
    for i in range(8):
        sched.add_request(make_req(f"r{i}", prompt_of(5, 10 * i), max_tokens=6))
    tokens, steps, most = run_batch_queue(sched, runner, 2)
    assert most == 2
    # prefill 4 + 4, then the two halves decode in turn
    assert [len(s.scheduled) for s in steps[:4]] == [4, 4, 4, 4]
    first = {it.request_id for it in steps[0].scheduled}
    assert {it.request_id for it in steps[2].scheduled} == first
    assert tokens == {f"r{i}": [1000 + n for n in range(6)] for i in range(8)}
    assert_all_blocks_free(sched)


def test_prompt_chunks_may_run_in_consecutive_micro_batches() -> None:
    sched = micro_batched(make_scheduler(budget=8), 2)
    runner = FakeRunner(sched)
    sched.add_request(make_req("long", prompt_of(20), max_tokens=3))
    tokens, steps, most = run_batch_queue(sched, runner, 2)
    # 20 prompt tokens in chunks of 8: two chunks in flight at once, none sampling before
    assert [s.scheduled[0].num_new_tokens for s in steps[:3]] == [8, 8, 4]
    assert most == 2
    assert tokens == {"long": [1000, 1001, 1002]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_under_a_small_pool_gives_the_same_tokens(seed: int) -> None:
    rng = random.Random(seed)
    reqs = [(f"r{i}", prompt_of(rng.randrange(3, 30), 7 * i), rng.randrange(1, 25))
            for i in range(12)]
    results = []
    for depth in (1, 2, 3):
        sched = micro_batched(make_scheduler(num_blocks=24, budget=32, max_seqs=8), depth)
        runner = FakeRunner(sched)
        for rid, prompt, n in reqs:
            sched.add_request(make_req(rid, prompt, max_tokens=n))
        tokens, _, most = run_batch_queue(sched, runner, depth)
        assert most == depth
        results.append((tokens, sched.num_preemptions))
        assert_all_blocks_free(sched)
    assert results[0][0] == results[1][0] == results[2][0]
    assert results[1][1] > 0 and results[2][1] > 0  # the pool was short
