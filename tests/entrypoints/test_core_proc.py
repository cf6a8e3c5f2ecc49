"""The engine-core busy loop over real ZMQ sockets, with a fake core (no model)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import threading

import msgspec
import pytest
import zmq

from shoal.core.errors import ErrorCode
from shoal.core.types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from shoal.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    OutputMessage,
    Rejection,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from shoal.engine.core_proc import EngineCoreProc
from shoal.sampling_params import SamplingParams


class FakeCore:
    """Each request yields one token per step and finishes after `max_tokens`."""

    def __init__(self):
        self.left: dict[str, int] = {}
        self.sent_first: set[str] = set()
        self.aborted: list[str] = []
        self.prefix_queries = 0

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.prompt_token_ids[0] < 0:
            raise ValueError("prompt_token_ids must be >= 0")
        if req.prompt_token_ids[0] == 0:  # a bug of the core's, not the client's fault
            raise KeyError("no slot")
        self.left[req.request_id] = req.sampling_params.max_tokens

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            if self.left.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> EngineCoreOutputs:
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            # Like the scheduler: the queue time rides on the first sampled output only.
            queue_time = None if rid in self.sent_first else 0.5
            self.sent_first.add(rid)
            outs.append(EngineCoreOutput(rid, [7], finish_reason="length" if done else None,
                                         queue_time=queue_time))
        self.prefix_queries += 10
        return EngineCoreOutputs(outs, SchedulerStats(num_running=len(self.left),
                                                      prefix_cache_queries=self.prefix_queries))


@contextlib.contextmanager
def _running_proc(name: str, death_fd: int | None = None):
    """(send, recv, core, thread) around an EngineCoreProc over inproc sockets `name`-in/out."""
    ctx = zmq.Context()
    to_engine, engine_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_in.bind(f"inproc://{name}-in")
    to_engine.connect(f"inproc://{name}-in")
    from_engine.bind(f"inproc://{name}-out")
    engine_out.connect(f"inproc://{name}-out")
    core = FakeCore()
    proc = EngineCoreProc(core, engine_in, engine_out, death_fd=death_fd)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(OutputMessage)
    from_engine.setsockopt(zmq.RCVTIMEO, 5000)

    def send(msg):
        to_engine.send(enc.encode(msg))

    def recv():
        return dec.decode(from_engine.recv())

    try:
        yield send, recv, core, thread
    finally:
        if thread.is_alive():
            send(Shutdown())
            thread.join(5)
        for s in (to_engine, engine_in, engine_out, from_engine):
            s.close(linger=0)
        ctx.term()


@pytest.fixture
def loop():
    """(send, recv, core, death_writer, thread) around a running EngineCoreProc."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    with _running_proc("loop", death_fd=reader.fileno()) as (send, recv, core, thread):
        yield send, recv, core, writer, thread


def _req(rid: str, first_token: int = 1, max_tokens: int = 2) -> AddRequest:
    return AddRequest(EngineCoreRequest(rid, [first_token, 2], SamplingParams(max_tokens=max_tokens),
                                        arrival_time=100.0))


def _collect_until_finished(recv, rid: str) -> list[CoreOutputs]:
    msgs = []
    while True:
        msg = recv()
        assert isinstance(msg, CoreOutputs)
        msgs.append(msg)
        if any(o.request_id == rid and o.finish_reason for o in msg.outputs.outputs):
            return msgs


def test_steps_until_done_with_queue_time_once(loop):
    send, recv, *_ = loop
    send(_req("a", max_tokens=3))
    msgs = _collect_until_finished(recv, "a")
    tokens = [t for m in msgs for o in m.outputs.outputs for t in o.new_token_ids]
    assert tokens == [7, 7, 7]
    queue_times = [o.queue_time for m in msgs for o in m.outputs.outputs
                   if o.queue_time is not None]
    assert queue_times == [0.5]
    assert msgs[-1].outputs.stats.prefix_cache_queries > 0


def test_bad_request_is_rejected_alone(loop):
    send, recv, core, *_ = loop
    send(_req("bad", first_token=-5))
    send(_req("broken", first_token=0))
    send(_req("good"))
    rejected, finished = {}, False
    while not finished:
        msg = recv()
        rejected.update(msg.rejected)
        finished = any(o.request_id == "good" and o.finish_reason for o in msg.outputs.outputs)
    assert rejected == {
        "bad": Rejection("prompt_token_ids must be >= 0", ErrorCode.BAD_REQUEST),
        "broken": Rejection("the engine failed to add this request: KeyError: 'no slot'",
                            ErrorCode.ENGINE_FAILED)}
    # The loop is still alive and serving.
    send(UtilityCall(1, "ping"))
    assert recv() == UtilityResult(1, "pong")


def test_abort_and_utilities(loop):
    send, recv, core, *_ = loop
    send(_req("long", max_tokens=10_000))
    assert isinstance(recv(), CoreOutputs)
    send(AbortRequests(["long"]))
    send(UtilityCall(2, "no_such_thing"))
    while True:
        msg = recv()
        if isinstance(msg, UtilityResult):
            break
    assert msg.call_id == 2 and "unknown utility" in msg.error
    assert core.aborted == ["long"]
    send(UtilityCall(3, "get_stats"))
    stats = recv().result
    assert stats["prefix_cache_queries"] > 0
    send(UtilityCall(4, "reset_stats"))
    assert recv().result is True
    send(UtilityCall(5, "get_stats"))
    assert recv().result.get("prefix_cache_queries", 0) == 0


def test_malformed_message_is_dropped(loop):
    send, recv, *_ = loop
    send({"not": "a message"})
    send(UtilityCall(9, "ping"))
    assert recv() == UtilityResult(9, "pong")


def test_parent_death_pipe_ends_the_loop(loop):
    *_, writer, thread = loop
    writer.close()  # what the kernel does when the frontend dies
    thread.join(10)
    assert not thread.is_alive()


def test_shutdown_message_ends_the_loop(loop):
    send, *_, thread = loop
    send(Shutdown())
    thread.join(10)
    assert not thread.is_alive()


def test_step_trace_records_every_step(tmp_path, monkeypatch):
    """SHOAL_STEP_TRACE: one line per step with its timings, the requests added and tokens."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("SHOAL_STEP_TRACE", str(path))
    with _running_proc("trace") as (send, recv, _core, thread):
        send(_req("a", max_tokens=3))
        _collect_until_finished(recv, "a")
        send(Shutdown())
        thread.join(5)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3  # one per step, written when the loop ends
    assert [r["added"] for r in lines] == [1, 0, 0]
    assert [r["running"] for r in lines] == [1, 1, 0]
    assert all(r["step_ms"] >= 0 and r["send_ms"] >= 0 for r in lines)
    assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]


def test_steps_that_do_nothing_do_not_spin(loop):
    """While the unfinished requests wait on something outside the step (a remote KV fetch),
    an idle step makes the loop wait EMPTY_STEP_POLL_MS for input instead of stepping again
    at once; a step that did work steps again at once."""
    import time

    from shoal.engine import core_proc

    send, recv, core, _, _ = loop
    waiting = threading.Event()
    steps = []
    real_step = core.step

    def step():
        steps.append(time.perf_counter())
        core.last_step_idle = waiting.is_set()
        return EngineCoreOutputs([], SchedulerStats()) if waiting.is_set() else real_step()

    core.step = step
    waiting.set()
    send(_req("w", max_tokens=1))
    time.sleep(0.3)
    idle_steps = len(steps)
    # at most one step per poll wait (plus scheduling slack), not a spin of thousands
    assert 2 <= idle_steps <= 0.3 / (core_proc.EMPTY_STEP_POLL_MS / 1e3) + 5
    waiting.clear()
    msgs = _collect_until_finished(recv, "w")
    assert msgs[-1].outputs.outputs[-1].finish_reason == "length"
