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


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The module's servers and the start that must fail, started at once: their starts
    overlap (most of one is imports, and each server's frontend waits for its engine
    process), where one after the other they took most of the module's time."""
    logs = tmp_path_factory.mktemp("lifecycle")
    # The frontend accepts the flag; the engine process rejects it while building its config
    # and must report the error through the start-up handshake.
    with (logs / "failing.log").open("w") as err:
        failing = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--port",
                                    str(free_port()), *BASE_ARGS, "--max-model-len", "999999"],
                                   stdout=subprocess.DEVNULL, stderr=err)
    procs = {"failing": (failing, logs / "failing.log"),
             "plain": RemoteServer(wait=False),
             "no_tokenizer": RemoteServer("--skip-tokenizer-init", "--max-num-seqs", "2",
                                          wait=False)}
    yield procs
    if failing.poll() is None:
        failing.kill()
        failing.wait()
    for srv in (procs["plain"], procs["no_tokenizer"]):
        srv.stop()


def test_engine_startup_error_exits_nonzero_with_message(started):
    proc, log = started["failing"]
    assert proc.wait(timeout=240) != 0
    stderr = log.read_text()
    assert "failed to start" in stderr and "max_model_len" in stderr, stderr[-2000:]


@pytest.fixture(scope="module")
def server(started):
    # Both servers up before the death test, whose 503 has a second to show.
    started["no_tokenizer"].wait_healthy()
    srv = started["plain"]
    srv.wait_healthy()
    return srv


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
        killed = time.monotonic()
        assert _first_health_503(server.base_url) - killed < 1.0  # 503 within a second
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


def _first_health_503(base_url: str, timeout_s: float = 10.0) -> float:
    """When /health first answers 503 (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 503:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"/health did not answer 503 within {timeout_s} s")


def test_api_server_count_out_of_range_is_refused_by_name():
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--api-server-count", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--api-server-count" in proc.stderr, proc.stderr[-2000:]


def test_shutdown_deadline_ends_requests_with_errors_over_a_unix_socket(tmp_path):
    """--uds, then SIGTERM with requests in flight and --shutdown-timeout 1: at the deadline
    the plain request gets a JSON 503 and the stream an "abort" finish, an error event and
    [DONE]; then the server exits 0 promptly."""
    sock = str(tmp_path / "shoal.sock")
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve",
                                 *BASE_ARGS, "--uds", sock, "--shutdown-timeout", "1"],
                                stdout=out, stderr=subprocess.STDOUT)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://shoal",
                        timeout=60)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "no server on the socket"
            time.sleep(0.1)
        assert http.get("/version").json()["version"]
        body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=http.post("/v1/completions",
                                                                       json=body)))
        t.start()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # both are generating now
            proc.send_signal(signal.SIGTERM)
            events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
        t.join(60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 503
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
        r = result["r"]
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        assert "shutdown-timeout" in r.json()["error"]["message"]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_skip_tokenizer_init_serves_token_ids_only(started):
    srv = started["no_tokenizer"]
    srv.wait_healthy()
    try:
        r = srv.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 3,
                                              "temperature": 0, "return_token_ids": True,
                                              "logprobs": 1, "ignore_eos": True})
        ch = r.json()["choices"][0]
        assert r.status_code == 200 and len(ch["token_ids"]) == 3 and ch["text"] == ""
        assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
        for path, body in (("/v1/completions", {"prompt": "text"}),
                           ("/v1/completions", {"prompt": [1, 2], "stop": ["x"]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]}),
                           ("/tokenize", {"prompt": "hi"})):
            bad = srv.post(path, json=body)
            assert bad.status_code == 400 and "tokenizer" in bad.json()["error"]["message"]
    finally:
        srv.stop()


def test_the_engine_is_spawned_before_the_http_stack_is_imported():
    # Start-up overlaps the frontend's imports with the engine's: the launcher must spawn the
    # engine process while FastAPI and uvicorn are still unimported.
    code = (
        "import asyncio, sys\n"
        "import shoal.engine.start_client as sc\n"
        "from shoal.engine.engine_args import EngineArgs\n"
        "from shoal.entrypoints.openai import server_launch\n"
        "from shoal.entrypoints.openai.server_settings import ServerSettings\n"
        "seen = []\n"
        "async def fake_start(args, **kw):\n"
        "    seen.append(sorted(m for m in ('fastapi', 'uvicorn', 'torch') if m in sys.modules))\n"
        "    raise ValueError('stop here')\n"
        "server_launch.start_engine_client = fake_start\n"
        "code = asyncio.run(server_launch.start_then_serve(EngineArgs(), ServerSettings()))\n"
        "print(code, seen)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "[[]]"], proc.stdout
    assert "failed to start: stop here" in proc.stderr


def test_a_bad_frontend_argument_fails_before_an_engine_process_starts():
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(free_port()),
           *BASE_ARGS, "--max-logprobs", "-2"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "max_logprobs must be >= 0" in proc.stderr, proc.stderr[-2000:]
    assert "[engine]" not in proc.stderr  # no engine process logged anything
    assert time.perf_counter() - t0 < 30
