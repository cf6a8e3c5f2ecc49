"""`shoal serve --api-server-count 2` on SmolLM2: two API processes over one engine core,
against a one-process server (conftest's shared one); what the processes share (stored
Responses, /load, run-time LoRA adapters), each reached through a keep-alive connection of its
own (pinned)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from lora.peft_adapters import write_raw_adapter  # tests/lora

from tests.entrypoints.conftest import RemoteServer

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):",
           "The opposite of hot is", "Water boils at", "My favourite colour is"]
HEADER = "x-shoal-api-server"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model's served name
# SmolLM2-135M's attention projections an adapter may target (limits.lora.targets)
SMOLLM2_QV = {f"model.layers.{i}.self_attn.{p}": (576, out)
              for i in range(30) for p, out in (("q_proj", 576), ("v_proj", 192))}
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(smollm2_server):
    """(two API processes, one): the one-process side is the package's shared server (its
    optional features change no greedy text and add no x-shoal-api-server header)."""
    pool = RemoteServer("--api-server-count", "2", "--enable-server-load-tracking",
                        "--enable-request-id-headers", "--root-path", "/llm", "--enable-lora",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield pool, smollm2_server
    pool.stop()


@pytest.fixture
def pinned(servers):
    """{"0": client, "1": client}: each keeps one connection, to the process it names (the
    kernel keeps a connection with the process it first gave it to)."""
    pool, _ = servers
    clients: dict[str, httpx.Client] = {}
    for _ in range(64):
        client = httpx.Client(base_url=pool.base_url, timeout=120)
        who = client.get("/health").headers[HEADER]
        if who in clients:
            client.close()
        else:
            clients[who] = client
        if len(clients) == 2:
            break
    assert set(clients) == {"0", "1"}
    yield clients
    for client in clients.values():
        client.close()


def _on(clients: dict[str, httpx.Client], who: str, method: str, path: str,
        **kw) -> httpx.Response:
    r = clients[who].request(method, path, **kw)
    assert r.headers[HEADER] == who, "the connection moved to another process"
    return r


def _load_everywhere(pool: RemoteServer) -> dict[str, int]:
    """/load as each process answers it (new connections until both have; with and without
    --root-path)."""
    seen: dict[str, int] = {}
    for i in range(64):
        r = httpx.get(pool.base_url + ("/llm/load" if i % 2 else "/load"), timeout=30)
        assert r.status_code == 200 and "x-request-id" in r.headers, r.text
        seen.setdefault(r.headers[HEADER], r.json()["server_load"])
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only {set(seen)} answered")


def _wait_load(pool: RemoteServer, want: int, timeout: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        loads = _load_everywhere(pool)
        if set(loads.values()) == {want} or time.monotonic() > deadline:
            return loads
        time.sleep(0.1)


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


def _text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


def _streamed_response(clients: dict[str, httpx.Client], who: str, body: dict) -> dict:
    """The Response object of a streamed create (its last event's)."""
    with clients[who].stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers[HEADER] == who
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    last = events[-1]["response"]  # (max_output_tokens reached: "incomplete")
    assert events[-1]["type"] == f"response.{last['status']}"
    return last


def test_a_stored_response_is_found_and_continued_through_the_other_process(pinned):
    """Both directions, plain and streamed: GET /v1/responses/{id} and previous_response_id
    through the process that did not make it; store: false is kept by neither."""
    for i in range(4):
        made_by, other = ("0", "1") if i % 2 == 0 else ("1", "0")
        body = {"model": MODEL, "input": f"Name a colour ({i}).", "max_output_tokens": 3,
                "temperature": 0}
        first = _streamed_response(pinned, made_by, body) if i >= 2 else \
            _on(pinned, made_by, "POST", "/v1/responses", json=body).json()
        got = _on(pinned, other, "GET", f"/v1/responses/{first['id']}")
        assert got.status_code == 200, got.text
        assert got.json() == first
        cont = _on(pinned, other, "POST", "/v1/responses", json={
            "model": MODEL, "input": "And another?", "max_output_tokens": 3, "temperature": 0,
            "previous_response_id": first["id"]}).json()
        # the earlier turns came along: the prompt is all three through the chat template
        turns = [{"role": "user", "content": body["input"]},
                 {"role": "assistant", "content": _text(first)},
                 {"role": "user", "content": "And another?"}]
        count = _on(pinned, other, "POST", "/tokenize", json={
            "model": MODEL, "messages": turns, "add_generation_prompt": True}).json()["count"]
        assert cont["usage"]["input_tokens"] == count
        back = _on(pinned, made_by, "GET", f"/v1/responses/{cont['id']}")
        assert back.status_code == 200 and back.json()["output"] == cont["output"]
    unstored = _on(pinned, "0", "POST", "/v1/responses", json={**body, "store": False}).json()
    for who in ("0", "1"):
        assert _on(pinned, who, "GET", f"/v1/responses/{unstored['id']}").status_code == 404


def test_load_counts_the_requests_in_flight_on_every_process(servers, pinned):
    pool, _ = servers
    assert _wait_load(pool, 0) == {"0": 0, "1": 0}
    with pinned["0"].stream("POST", "/v1/completions", json=LONG) as s0:
        assert s0.headers[HEADER] == "0"
        lines0 = s0.iter_lines()  # (held: a generator dropped closes the stream)
        assert next(lines0).startswith("data: ")
        assert _load_everywhere(pool) == {"0": 1, "1": 1}  # process 1 counts 0's request
        with pinned["1"].stream("POST", "/v1/completions", json=LONG) as s1:
            assert s1.headers[HEADER] == "1"
            lines1 = s1.iter_lines()
            assert next(lines1).startswith("data: ")
            assert _load_everywhere(pool) == {"0": 2, "1": 2}
    assert _wait_load(pool, 0) == {"0": 0, "1": 0}  # cut off: both count down


def test_adapters_loaded_through_either_process_are_served_by_both(servers, pinned,
                                                                   tmp_path):
    """Two adapters, one loaded through each process: each process numbering its own would
    give both the same engine id (so one adapter's weights for both names)."""
    folders = {name: str(write_raw_adapter(tmp_path / name, SMOLLM2_QV, seed=seed,
                                           scale=0.15))
               for name, seed in (("qa", 1), ("qb", 2))}

    def complete(who: str, model: str) -> httpx.Response:
        return _on(pinned, who, "POST", "/v1/completions", json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0})

    def adapters(who: str) -> dict[str, str]:
        return {m["id"]: m["root"] for m in _on(pinned, who, "GET", "/v1/models").json()["data"]
                if m["id"] != MODEL}

    for name, who in (("qa", "0"), ("qb", "1")):
        r = _on(pinned, who, "POST", "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": folders[name]})
        assert r.status_code == 200, r.text
    assert adapters("0") == adapters("1") == folders
    again = _on(pinned, "1", "POST", "/v1/load_lora_adapter",
                json={"lora_name": "qa", "lora_path": folders["qa"]})
    assert again.status_code == 400 and "already been loaded" in again.text
    base = complete("1", MODEL).json()["choices"][0]["text"]
    texts = {(name, who): complete(who, name).json()["choices"][0]["text"]
             for name in folders for who in ("0", "1")}
    assert texts["qa", "0"] == texts["qa", "1"] != base
    assert texts["qb", "0"] == texts["qb", "1"] not in (base, texts["qa", "0"])
    assert _on(pinned, "1", "POST", "/v1/unload_lora_adapter",
               json={"lora_name": "qa"}).status_code == 200
    assert adapters("0") == {"qb": folders["qb"]}
    assert complete("0", "qa").status_code == 404
    assert _on(pinned, "0", "POST", "/v1/unload_lora_adapter",
               json={"lora_name": "qa"}).status_code == 404
    assert complete("0", "qb").json()["choices"][0]["text"] == texts["qb", "0"]
    assert _on(pinned, "0", "POST", "/v1/unload_lora_adapter",
               json={"lora_name": "qb"}).status_code == 200
    assert adapters("1") == {}


def _restarted(pool: RemoteServer, pid: int, timeout: float = 10.0) -> tuple[str, int]:
    """(index, new pid) from the supervisor's log line for the death of API process `pid`."""
    pattern = re.compile(rf"API server process (\d+) \(pid {pid}\) died \(killed by signal "
                         r"SIGKILL\); restarted as pid (\d+) \(restart 1 of 5 ")
    deadline = time.monotonic() + timeout
    while not (found := pattern.search(pool.log_path.read_text(errors="replace"))):
        assert time.monotonic() < deadline, pool.log_tail()
        time.sleep(0.05)
    return found[1], int(found[2])


def _connect_to(pool: RemoteServer, who: str, timeout: float = 60.0) -> httpx.Client:
    """A client whose keep-alive connection the kernel gave to API process `who` (new
    connections until one lands there: it counts only once that process listens)."""
    deadline = time.monotonic() + timeout
    while True:
        client = httpx.Client(base_url=pool.base_url, timeout=60)
        if client.get("/health").headers[HEADER] == who:
            return client
        client.close()
        assert time.monotonic() < deadline, f"API process {who} never came back"
        time.sleep(0.05)


def test_killing_one_api_process_leaves_the_other_and_the_engine_and_it_comes_back(
        servers, pinned):
    pool, _ = servers
    api = _api_pids(pool)
    assert len(api) == 2
    engine = [c for c in _children(pool.proc.pid) if c not in api
              and b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engine) == 1
    restarts_before = pool.metric("api_server_restarts_total")
    with contextlib.ExitStack() as streams:
        lines = []  # (held: a generator dropped closes its stream)
        for who in ("0", "1"):  # a request in flight on each: the dead one's leaves /load
            lines.append(streams.enter_context(pinned[who].stream(
                "POST", "/v1/completions", json=LONG)).iter_lines())
            assert next(lines[-1]).startswith("data: ")
        assert pool.get("/load").json()["server_load"] == 2
        os.kill(api[0], signal.SIGKILL)
        killed, new_pid = _restarted(pool, api[0])
        survivor = "1" if killed == "0" else "0"
        assert new_pid not in api
        # while the new one starts (seconds: a fresh interpreter), new connections go to the
        # survivor
        for _ in range(3):
            r = httpx.get(pool.base_url + "/health", timeout=10)
            assert r.status_code == 200 and r.headers[HEADER] == survivor
        # the survivor and the engine serve on, its stream included
        assert any(line.startswith("data: ") for line in lines[int(survivor)])
        r = _on(pinned, survivor, "POST", "/v1/completions",
                json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert _on(pinned, survivor, "GET", "/load").json()["server_load"] == 1
    # the new process serves on the killed one's index, as a client of the same engine
    pinned[killed].close()  # (its connection died with the process)
    pinned[killed] = _connect_to(pool, killed)
    r = _on(pinned, killed, "POST", "/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert sorted(_api_pids(pool)) == sorted([api[1], new_pid])
    assert pool.proc.poll() is None and Path(f"/proc/{engine[0]}").exists()
    # /load: the dead process's request is gone from every count, the new one counts its own
    assert _wait_load(pool, 0) == {"0": 0, "1": 0}
    with pinned[survivor].stream("POST", "/v1/completions", json=LONG) as s:
        held = s.iter_lines()
        assert next(held).startswith("data: ")
        assert _on(pinned, killed, "GET", "/load").json()["server_load"] == 1
        with pinned[killed].stream("POST", "/v1/completions", json=LONG) as s2:
            held2 = s2.iter_lines()
            assert next(held2).startswith("data: ") and s2.headers[HEADER] == killed
            assert _load_everywhere(pool) == {"0": 2, "1": 2}
    assert _wait_load(pool, 0) == {"0": 0, "1": 0}
    metrics = pool.get("/metrics").text
    assert f'shoal:api_server_restarts_total{{api_server="{killed}"}} 1.0' in metrics
    assert pool.metric("api_server_restarts_total") == restarts_before + 1
    pool.proc.send_signal(signal.SIGTERM)  # both drain, nothing is restarted, the engine stops
    assert pool.proc.wait(timeout=60) == 0, pool.log_tail()
    assert not Path(f"/proc/{engine[0]}").exists()
    assert pool.log_path.read_text(errors="replace").count("restarted as pid") == 1


def test_combinations_that_cannot_work_are_refused_by_name():
    for extra, words in ((["--data-parallel-size", "2"], "--data-parallel-size 2"),
                         (["--uds", "/tmp/shoal-never.sock"], "--uds"),
                         (["--grpc-port", "50999"], "--grpc-port")):
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--api-server-count", "2", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
