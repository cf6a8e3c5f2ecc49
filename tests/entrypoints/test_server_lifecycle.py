"""Start-up failure and engine death: the server must fail loudly, with a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import BASE_ARGS, RemoteServer, free_port

PROMPT = "The capital of France is"


def test_engine_startup_error_exits_nonzero_with_message():
    # The frontend accepts the flag; the engine process rejects it while building its config
    # and must report the error through the start-up handshake.
    cmd = [sys.executable, "-m", "shoal.entrypoints.cli", "serve", "--port", str(free_port()),
           *BASE_ARGS, "--max-model-len", "999999"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "failed to start" in proc.stderr and "max_model_len" in proc.stderr, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer()
    yield srv
    srv.stop()


def test_engine_death_fails_requests_and_exits_nonzero(server):
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    result: dict = {}

    def post():
        result["resp"] = server.post("/v1/completions", json=body)

    t = threading.Thread(target=post)
    t.start()
    events = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # both requests are generating now
        os.kill(server.engine_pid(), signal.SIGKILL)
        events = [ln for ln in lines if ln.startswith("data: ")]
    t.join(60)
    # The streaming client gets an in-band error and [DONE]; the other one a 503 body.
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 503
    resp = result["resp"]
    assert resp.status_code == 503 and "engine" in resp.json()["error"]["message"]
    # /health reports the death until the server is gone; then the process exits non-zero.
    statuses = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            statuses.add(httpx.get(server.base_url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert statuses == {503}
    assert server.proc.wait(30) != 0
