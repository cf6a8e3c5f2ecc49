"""`shoal serve` with VLLM_SERVER_DEV_MODE=1: POST /pause aborts a streaming request in flight
(its stream ends with finish_reason "abort"), GET /is_paused, a request sent while paused waits
and completes after POST /resume with the tokens of before; with wait_for_inflight_requests
the request in flight runs to its end before /pause returns."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from oracle import write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow
LONG = {"prompt": [5, 6, 7, 8] * 4, "max_tokens": 1500, "ignore_eos": True, "stream": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_gguf):
    base = write_tiny_checkpoint(tmp_path_factory.mktemp("pause"), "llama", seed=0,
                                 vocab_size=49152, max_position_embeddings=2048)
    folder, name = smollm_gguf
    srv = RemoteServer(str(base), "--tokenizer", f"{folder}/{name}", "--dtype", "float32",
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "2048"],
                       env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


def _complete(srv) -> list[int]:
    r = srv.post("/v1/completions", json={"prompt": [5, 6, 7, 8, 9] * 8, "max_tokens": 6,
                                          "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


class Stream(threading.Thread):
    """A long streaming completion read in the background: its chunks' finish reasons."""

    def __init__(self, srv) -> None:
        super().__init__(daemon=True)
        self.srv, self.started, self.reasons, self.text = srv, threading.Event(), [], ""
        self.start()
        assert self.started.wait(60)

    def run(self) -> None:
        with httpx.stream("POST", self.srv.base_url + "/v1/completions", json=LONG,
                          timeout=120) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.reasons.append(choice.get("finish_reason"))
                self.text += choice.get("text") or ""
                self.started.set()


def test_pause_aborts_in_flight_and_resume_runs_the_queued(server) -> None:
    before = _complete(server)
    assert server.get("/is_paused").json() == {"is_paused": False}
    stream = Stream(server)
    assert server.post("/pause").status_code == 200
    stream.join(30)
    assert not stream.is_alive() and stream.reasons[-1] == "abort"
    assert len(stream.reasons) < LONG["max_tokens"]
    assert server.get("/is_paused").json() == {"is_paused": True}
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(_complete(server)), daemon=True)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive()  # queued while paused
    assert server.post("/resume").status_code == 200
    waiter.join(30)
    assert got == [before]
    assert server.get("/is_paused").json() == {"is_paused": False}


def test_pause_waits_for_in_flight(server) -> None:
    stream = Stream(server)
    r = server.post("/pause", params={"wait_for_inflight_requests": "true",
                                      "clear_cache": "false"})
    assert r.status_code == 200
    stream.join(30)
    assert stream.reasons[-1] == "length"
    assert server.get("/is_paused").json() == {"is_paused": True}
    assert server.post("/resume").status_code == 200
    _complete(server)
