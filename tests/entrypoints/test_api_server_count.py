"""`shoal serve --api-server-count 2` on SmolLM2: two API processes over one engine core,
against a one-process server (conftest's shared one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):",
           "The opposite of hot is", "Water boils at", "My favourite colour is"]
HEADER = "x-shoal-api-server"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model's served name


@pytest.fixture(scope="module")
def servers(smollm2_server):
    """(two API processes, one): the one-process side is the package's shared server (its
    optional features change no greedy text and add no x-shoal-api-server header)."""
    pool = RemoteServer("--api-server-count", "2")
    yield pool, smollm2_server
    pool.stop()


def _complete(server: RemoteServer, prompt: str) -> tuple[str, str, int]:
    raw = server.openai().completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    body = raw.parse()
    return body.choices[0].text, raw.headers.get(HEADER, ""), body.usage.completion_tokens


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _api_pids(server: RemoteServer) -> list[int]:
    """The API processes: each leads its own process group (the engine does not)."""
    return [c for c in _children(server.proc.pid)
            if os.getpgid(c) == c and b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_concurrent_requests_match_one_process_and_reach_both(servers):
    pool, single = servers
    prompts = PROMPTS * 4
    before = pool.metric("request_success_total")
    tokens_before = pool.metric("generation_tokens_total")
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: _complete(pool, p), prompts))
        want = list(ex.map(lambda p: _complete(single, p), PROMPTS))
    assert [text for text, _, _ in got] == [text for text, _, _ in want] * 4
    assert {who for _, who, _ in got} == {"0", "1"}, "both API processes served requests"
    assert not any(who for _, who, _ in want)  # one process: no header
    # One scrape, from either process, shows the totals of both and the engine's once.
    total = pool.wait_metric("request_success_total", lambda v: v >= before + len(prompts))
    assert total == before + len(prompts)
    generated = sum(n for _, _, n in got)
    assert pool.wait_metric("generation_tokens_total",
                            lambda v: v >= tokens_before + generated) == tokens_before + generated
    scrapes = [httpx.get(pool.base_url + "/metrics", timeout=30) for _ in range(12)]
    assert {r.headers[HEADER] for r in scrapes} == {"0", "1"}
    for r in scrapes:
        assert "shoal:api_server_requests_total{api_server=\"1\"}" in r.text
        assert sum(float(x.rsplit(" ", 1)[1]) for x in r.text.splitlines()
                   if x.startswith("shoal:request_success_total{")) == total


def test_a_stream_cut_off_mid_way_leaves_the_others_alone(servers):
    pool, _ = servers
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", pool.base_url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                  "temperature": 0, "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert any(line.startswith("data: ") for line in lines)
    # the connection is closed mid-stream: the others go on, and the engine drops it
    with ThreadPoolExecutor(6) as ex:
        assert all(text for text, _, _ in ex.map(lambda p: _complete(pool, p), PROMPTS))
    assert pool.wait_metric("num_requests_running", lambda v: v == 0) == 0
    assert pool.get("/health").status_code == 200


def test_killing_one_api_process_leaves_the_other_and_the_engine(servers):
    pool, _ = servers
    api = _api_pids(pool)
    assert len(api) == 2
    engine = [c for c in _children(pool.proc.pid) if c not in api
              and b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engine) == 1
    os.kill(api[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{api[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    served = set()
    for prompt in PROMPTS:  # new connections each: the kernel sends them to the survivor
        r = httpx.post(pool.base_url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        served.add(r.headers[HEADER])
    assert len(served) == 1
    assert pool.get("/health").status_code == 200
    assert pool.proc.poll() is None and Path(f"/proc/{engine[0]}").exists()
    assert _api_pids(pool) == [api[1]]
    pool.proc.send_signal(signal.SIGTERM)  # the survivor drains, then the engine stops
    assert pool.proc.wait(timeout=60) == 0, pool.log_tail()
    assert not Path(f"/proc/{engine[0]}").exists()


def test_combinations_that_cannot_work_are_refused_by_name():
    for extra, words in ((["--data-parallel-size", "2"], "--data-parallel-size 2"),
                         (["--uds", "/tmp/shoal-never.sock"], "--uds"),
                         (["--grpc-port", "50999"], "--grpc-port")):
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--api-server-count", "2", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
