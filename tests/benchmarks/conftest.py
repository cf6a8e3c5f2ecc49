"""The fake OpenAI server (shoal.benchmarks.fake_server) in a thread of the test process."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from shoal.benchmarks.fake_server import FakeTiming, make_socket, serve


class FakeServer:
    def __init__(self, ttft_ms: float = 0.0, itl_ms: float = 0.0):
        self.sock = make_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self._task: asyncio.Task | None = None
        timing = FakeTiming(ttft_ms / 1000, itl_ms / 1000)
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self._task = self.loop.create_task(serve(self.sock, timing))
            self.loop.call_soon(started.set)
            try:
                self.loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._task is not None:
            self.loop.call_soon_threadsafe(self._task.cancel)
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_fake_server():
    """50 ms to the first token, 10 ms between tokens."""
    server = FakeServer(ttft_ms=50, itl_ms=10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prof():
    """benchmarks/step_profile_gpu.py as a module (benchmarks/ is not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import step_profile_gpu
    finally:
        sys.path.pop(0)
    return step_profile_gpu
