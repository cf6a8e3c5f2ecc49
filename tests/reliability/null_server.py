"""`shoal serve`'s real frontend over the model-free NullEngineCore, for load, overload and
disconnect tests (and benchmarks/reliability_cpu.py). Run as a script:

    python null_server.py PORT STEP_MS MAX_NUM_SEQS MAX_WAITING_REQUESTS MAX_MODEL_LEN \
        [REQUEST_TIMEOUT]

or start it from a test with NullServer(...)."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# The shared test server (conftest.py): small limits so a burst can pass them, a short
# context so generated max_tokens stay small.
NULL_MAX_SEQS, NULL_MAX_WAITING, NULL_MAX_MODEL_LEN = 64, 256, 128
# The overload burst's server: 20-token requests take a second, so none finishes while a
# burst of 2 x (max_num_seqs + max_waiting_requests) arrives, however fast the client is.
OVERLOAD_MAX_SEQS, OVERLOAD_MAX_WAITING = 8, 24
OVERLOAD_SERVER = {"step_ms": 50.0, "max_num_seqs": OVERLOAD_MAX_SEQS,
                   "max_waiting": OVERLOAD_MAX_WAITING, "max_model_len": NULL_MAX_MODEL_LEN}


def main(port: int, step_ms: float, max_num_seqs: int, max_waiting: int,
         max_model_len: int, request_timeout: float | None = None) -> int:
    from shoal.benchmarks.null_engine import build_null_core
    from shoal.engine.engine_args import EngineArgs
    from shoal.entrypoints.openai.api_server import serve
    from shoal.entrypoints.openai.server_settings import ServerSettings

    args = EngineArgs(max_num_seqs=max_num_seqs, max_waiting_requests=max_waiting,
                      max_model_len=max_model_len, request_timeout=request_timeout,
                      device="cpu")
    build = functools.partial(build_null_core, step_time_s=step_ms / 1000, vocab_size=49152)
    settings = ServerSettings(host="127.0.0.1", port=port, disable_uvicorn_access_log=True)
    return asyncio.run(serve(args, settings, build_core=build))


class NullServer:
    def __init__(self, step_ms: float = 5.0, max_num_seqs: int = 256,
                 max_waiting: int = 4096, max_model_len: int = 8192,
                 startup_timeout: float = 120.0, request_timeout: float | None = None):
        from entrypoints.conftest import free_port

        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="shoal-null-", suffix=".log")[1])
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, str(Path(__file__)), str(self.port), str(step_ms),
               str(max_num_seqs), str(max_waiting), str(max_model_len),
               *([str(request_timeout)] if request_timeout is not None else [])]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text()[-3000:])
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the null server did not start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def burst(base_url: str, n: int, max_tokens: int = 20) -> dict[int, list[httpx.Response]]:
    """n completions sent at once; the responses by status code."""
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as client:
            body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body)
                                          for _ in range(n)))
    by_status: dict[int, list[httpx.Response]] = {}
    for r in asyncio.run(go()):
        by_status.setdefault(r.status_code, []).append(r)
    return by_status


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]),
                          int(sys.argv[4]), int(sys.argv[5]),
                          float(sys.argv[6]) if len(sys.argv) > 6 else None))
