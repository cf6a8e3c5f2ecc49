"""A server under test in its own process (`shoal serve`, vLLM's API server, the fake server):
start it on a free port, wait for its health URL, stop it with SIGTERM. Standard library only.

    with ServerProcess([python, *SHOAL_CLI, "serve", "--port", str(port)],
                       port, log=out / "server.log") as server:
        print(server.ready_s, server.url)
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

# How `shoal serve` is started from a script: the CLI module (a console script may be absent);
# shoal/cli.py since the seams refactor, shoal/entrypoints/cli.py in older trees.
SHOAL_CLI = ("-m", "shoal.cli" if importlib.util.find_spec("shoal.cli") is not None
             else "shoal.entrypoints.cli")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts `cmd` (which must listen on `port`) and waits until `ready_path` answers 200;
    ready_s: seconds from the spawn to that answer. Output goes to `log` (else discarded)."""

    def __init__(self, cmd: list[str], port: int, *, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, log: Path | None = None,
                 ready_path: str = "/health", timeout: float = 300.0, poll_s: float = 0.1):
        self.cmd, self.port, self.log = cmd, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._out: Any = log.open("wb") if log is not None else None
        t0 = time.monotonic()
        # cwd matters: `python -m` puts it first on sys.path, before PYTHONPATH.
        self.proc = subprocess.Popen(cmd, stdout=self._out or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            self._wait(ready_path, timeout, poll_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0

    def _wait(self, path: str, timeout: float, poll_s: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}"
                                   + (f"; log: {self.log}" if self.log else ""))
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(poll_s)
        raise RuntimeError(f"server not ready after {timeout} s"
                           + (f"; log: {self.log}" if self.log else ""))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._out is not None:
            self._out.close()
            self._out = None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
