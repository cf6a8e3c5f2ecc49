"""A real `shoal serve` subprocess for the server tests (one per module: start-up is slow), and
one shared by the modules whose checks hold on vLLM's optional features (smollm2_server)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BASE_ARGS = ["--kv-cache-memory-bytes", "268435456", "--max-model-len", "2048",
             "--disable-uvicorn-access-log"]
STARTUP_TIMEOUT = 300.0
# vLLM's optional features on (test_api_parity checks each): the shared server's flags.
PARITY_ARGS = ["--enable-tokenizer-info-endpoint", "--enable-request-id-headers",
               "--enable-server-load-tracking", "--enable-prompt-tokens-details",
               "--enable-force-include-usage", "--max-logprobs", "-1",
               "--root-path", "/llm", "--max-stored-responses", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of n consecutive free ports (what a server binding port + rank needs: a
    free port's neighbour may be any other socket's)."""
    for _ in range(100):
        base = free_port()
        try:
            with contextlib.ExitStack() as held:
                for port in range(base + 1, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports found")


class ProxyProcess:
    """A `shoal <command>` front (proxy, router) on a free port, its /health waited for;
    stop() ends it."""

    def __init__(self, command: str, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "--log-level", "WARNING", command,
             "--host", "127.0.0.1", "--port", str(self.port), *args])
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{command} exited"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{command} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class RemoteServer:
    def __init__(self, *args: str, api_key: str | None = None,
                 base_args: list[str] | None = None, env: dict[str, str] | None = None,
                 wait: bool = True):
        """base_args: replaces BASE_ARGS (sized for SmolLM2) for other models; env: added to
        the server's environment; wait=False: returns at once (wait_healthy() later), so
        that other processes can start meanwhile."""
        self.port = free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(self.port),
               *(BASE_ARGS if base_args is None else base_args), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = Path(tempfile.mkstemp(prefix="shoal-server-", suffix=".log")[1])
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        if wait:
            self.wait_healthy()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            # A refused connection costs next to nothing: polling often saves ~0.2 s of a
            # start on average, over the suite's ~40 servers.
            time.sleep(0.1)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{tail}")

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.base_url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("timeout", 120)
        kw["headers"] = {**self.headers, **kw.get("headers", {})}
        return httpx.post(self.base_url + path, **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        """The value of a `shoal:` series (summed over labels), from /metrics."""
        total, found = 0.0, False
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(f"shoal:{name}{{") or line.startswith(f"shoal:{name} "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"no metric shoal:{name}"
        return total

    def wait_metric(self, name: str, predicate, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.25)

    def engine_pid(self) -> int:
        """The spawned engine-core child (not multiprocessing's resource tracker)."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(child)
        raise RuntimeError("no engine process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.log_path.unlink(missing_ok=True)


def start_together(*starts: Callable[[], RemoteServer]) -> list[RemoteServer]:
    """Servers started at once, their starts overlapping (most of a start waits on imports and
    the other process of the server); if one fails, the started ones are stopped."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started, error = [], None
    for future in futures:
        try:
            started.append(future.result())
        except Exception as e:  # re-raised below, after the cleanup
            error = error or e
    if error is not None:
        for srv in started:
            srv.stop()
        raise error
    return started


@pytest.fixture(scope="package")
def smollm2_server():
    """The embedded SmolLM2 with PARITY_ARGS, one for the package: test_api_parity,
    test_token_ids_and_beam_search, test_bench_serve and test_api_server_count's one-process
    side need nothing else (a start of 5-10 s saved per module)."""
    srv = RemoteServer(*PARITY_ARGS)
    yield srv
    srv.stop()
