"""Rank 0 of the mp executor leaves its process group before the interpreter tears down, on
every way out of a process: an offline LLM still alive at exit, one whose engine shutdown
failed, a start that failed after the ranks joined, and a process that leaves with os._exit
after release_all() (as core_proc._exit_at_once ends the server's engine process). Otherwise
torch destroys the group object during teardown and NCCL warns "process group has NOT been
destroyed" (gloo says nothing, so on the CPU the script itself reports whether the group is
still initialized once every atexit callback and finalizer has run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import atexit, sys

def _report():  # registered first, so it runs after every other atexit callback
    import torch.distributed as dist
    print(f"GROUP_ALIVE_AT_EXIT={dist.is_initialized()}", file=sys.stderr, flush=True)

atexit.register(_report)
from shoal import LLM, SamplingParams

mode = sys.argv[2]
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32",
          max_model_len=128, kv_cache_memory_bytes=100 if mode == "failed_start" else 2**22)
llm.generate([{"prompt_token_ids": [5, 17, 300]}], SamplingParams(max_tokens=2),
             use_tqdm=False)
if mode == "os_exit":  # how the server's engine process ends (core_proc._exit_at_once)
    import os

    from shoal.executor.multiproc import release_all

    release_all()
    assert not llm.llm_engine.core.runner._procs  # the worker rank stopped and joined
    _report()
    os._exit(0)
if mode == "core_shutdown_fails":
    def _fail():
        raise RuntimeError("the engine core's shutdown failed")

    llm.llm_engine.core.shutdown = _fail
print("END_OF_SCRIPT", file=sys.stderr, flush=True)
"""
_NCCL_WARNINGS = ("has NOT been destroyed", "destroy_process_group() was not called")
MODES = ["alive_at_exit", "core_shutdown_fails", "failed_start", "os_exit"]


@pytest.fixture(scope="module")
def exits(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """mode -> (exit code, stderr) of the script: the four processes (and their worker ranks)
    run at once, each mostly importing and starting up, which the two cores overlap. (stderr
    to files: a full pipe nobody reads yet would stop a process mid-way.)"""
    logs = tmp_path_factory.mktemp("exits")
    procs = {}
    try:
        for mode in MODES:
            with (logs / mode).open("w") as err:
                procs[mode] = subprocess.Popen(
                    [sys.executable, "-c", _SCRIPT, str(tiny_llama_dir), mode],
                    stdout=subprocess.DEVNULL, stderr=err, text=True)
        return {mode: (p.wait(timeout=300), (logs / mode).read_text())
                for mode, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("mode", MODES)
def test_rank_0_destroys_its_group_before_teardown(exits, mode):
    returncode, err = exits[mode]
    if mode == "os_exit":  # no atexit callback ran: release_all() did it
        assert returncode == 0 and "END_OF_SCRIPT" not in err
    elif mode == "failed_start":
        assert returncode == 1 and "not enough memory for the KV cache" in err, err[-3000:]
    else:
        assert "END_OF_SCRIPT" in err, err[-3000:]
    assert "GROUP_ALIVE_AT_EXIT=False" in err, err[-3000:]
    assert not any(w in err for w in _NCCL_WARNINGS), err[-3000:]


def test_engine_process_exit_releases_the_ranks(monkeypatch):
    """The server's engine process ends with os._exit (no finalizer runs): core_proc's exit
    releases the ranks of any mp executor first, and still exits when that fails."""
    import types

    from shoal.engine import core_proc

    released, exits = [], []
    fake = types.SimpleNamespace(release_all=lambda: released.append(True))
    monkeypatch.setitem(sys.modules, "shoal.executor.multiproc", fake)
    monkeypatch.setattr(core_proc.logging, "shutdown", lambda: None)
    monkeypatch.setattr(core_proc.os, "_exit", exits.append)
    core_proc._exit_at_once(3)
    assert released == [True] and exits == [3]

    def broken():
        raise RuntimeError("a rank would not stop")

    fake.release_all = broken
    core_proc._exit_at_once(4)
    assert exits == [3, 4]


def test_a_command_to_a_worker_that_died_unseen_fails_instead_of_blocking(tmp_path):
    """A PUSH whose worker was killed before its exit shows (is_alive still true) would block
    for ever: the broadcast checks the workers after SEND_TIMEOUT_MS and raises."""
    import time
    from types import SimpleNamespace

    import msgspec
    import pytest
    import zmq

    from shoal.executor import multiproc

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.bind(f"ipc://{tmp_path}/nobody")  # no worker ever connects: every send would block
    checks = []

    def raise_if_dead(cause=None):
        checks.append(cause)
        if cause is not None:  # (the wait for the exit to show: it has by now)
            raise multiproc.WorkerDiedError("tensor-parallel worker(s) shoal-tp-rank1 exited")

    fake = SimpleNamespace(_raise_if_dead=raise_if_dead, _encoder=msgspec.msgpack.Encoder(),
                           _ranks=SimpleNamespace(sockets=[sock]))
    start = time.monotonic()
    try:
        with pytest.raises(multiproc.WorkerDiedError):
            multiproc.MultiprocExecutor._broadcast(fake, {"cmd": 1})
    finally:
        sock.close(linger=0)
        ctx.term()
    assert time.monotonic() - start < 5 and checks[0] is None and checks[-1] is not None
