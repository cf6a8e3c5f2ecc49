"""SIGTERM in the engine-core process sets a stop flag the loop checks between steps (review
finding 3): a step that is running finishes, then the core shuts down; an idle loop wakes at
once."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import signal
import time

import msgspec
import pytest
import zmq
from fake_cores import build_signalled_core

from shoal.core.types import EngineCoreRequest
from shoal.engine.core_messages import AddRequest, OutputMessage, Ready
from shoal.engine.core_proc import run_engine_core
from shoal.engine.engine_args import EngineArgs
from shoal.sampling_params import SamplingParams


@pytest.fixture
def engine(tmp_path):
    """Starts run_engine_core with a SignalledCore; yields (start, send, log path)."""
    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    in_addr, out_addr = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    to_engine.bind(in_addr)
    from_engine.bind(out_addr)
    log = tmp_path / "events"
    procs = []

    def start(signal_in_step: bool):
        build = functools.partial(build_signalled_core, str(log), signal_in_step)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(EngineArgs(), in_addr, out_addr, None, None, logging.WARNING, build))
        proc.start()
        procs.append(proc)
        assert from_engine.poll(60_000), "the engine never reported ready"
        msg = msgspec.msgpack.decode(from_engine.recv(), type=OutputMessage)
        assert isinstance(msg, Ready)
        return proc

    def send(msg) -> None:
        to_engine.send(msgspec.msgpack.encode(msg))

    yield start, send, log
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    to_engine.close(0)
    from_engine.close(0)
    ctx.term()


def test_sigterm_inside_a_step_lets_the_step_finish_then_shuts_down(engine):
    start, send, log = engine
    proc = start(signal_in_step=True)
    send(AddRequest(EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=4),
                                      time.monotonic())))
    proc.join(30)
    assert proc.exitcode == 0
    assert log.read_text().split("\n")[:-1] == ["ready", "step-start", "step-end True",
                                                "shutdown"]


def test_sigterm_wakes_an_idle_loop_at_once(engine):
    start, _, log = engine
    proc = start(signal_in_step=False)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(60)
    # The idle poll waits 120 s here (fake_cores.py); the signal's self-pipe cuts it short.
    assert proc.exitcode == 0
    assert log.read_text().split("\n")[:-1] == ["ready", "shutdown"]
