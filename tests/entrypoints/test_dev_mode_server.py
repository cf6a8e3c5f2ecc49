"""`shoal serve` with VLLM_SERVER_DEV_MODE=1, one server for every dev route (each test leaves it
awake, resumed and on the first weights, except the weight update, which runs last):
- /sleep (level 1), /is_sleeping and /wake_up around greedy completions (the same tokens after
  the round trip), requests refused while asleep, the engine_sleep_state gauge,
  /reset_prefix_cache;
- POST /pause aborts a streaming request in flight (its stream ends with finish_reason
  "abort"), GET /is_paused, a request sent while paused waits and completes after POST /resume
  with the tokens of before; with wait_for_inflight_requests the request in flight runs to its
  end before /pause returns;
- weight updates from a training loop: POST /pause, POST /update_weights_from_path {"path":
  another checkpoint}, POST /resume, then greedy tokens are transformers' on the new weights and
  the prefix cache holds nothing of the old ones; POST /collective_rpc {"method":
  "weights_checksum"} (one result per rank) follows the update; bad methods, arguments and
  paths are 400s, an update while a request runs a 409, and neither route exists without dev
  mode."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from oracle import hf_greedy, write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8, 9] * 8
TINY = {"vocab_size": 49152, "max_position_embeddings": 2048}
LONG = {"prompt": [5, 6, 7, 8] * 4, "max_tokens": 1500, "ignore_eos": True, "stream": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return (write_tiny_checkpoint(tmp_path_factory.mktemp("w0"), "llama", seed=0, **TINY),
            write_tiny_checkpoint(tmp_path_factory.mktemp("w1"), "llama", seed=1, **TINY))


@pytest.fixture(scope="module")
def server(checkpoints, smollm_gguf):
    folder, name = smollm_gguf
    srv = RemoteServer(str(checkpoints[0]), "--tokenizer", f"{folder}/{name}",
                       "--dtype", "float32", "--enable-prompt-tokens-details",
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "2048"],
                       env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


def _cached_complete(srv) -> tuple[list[int], int]:
    """Greedy tokens of PROMPT and how many of its tokens the prefix cache had."""
    r = srv.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6,
                                          "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _complete(srv) -> list[int]:
    return _cached_complete(srv)[0]


def _sleep_gauge(srv) -> dict[str, float]:
    out = {}
    for line in srv.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            state = line.split('sleep_state="')[1].split('"')[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


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


def _checksum(srv) -> list[float]:
    r = srv.post("/collective_rpc", json={"method": "weights_checksum"})
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _hf_tokens(path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(model, PROMPT, 6)[0]


def test_sleep_and_wake_keep_the_tokens(server) -> None:
    before = _complete(server)
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.post("/sleep", params={"level": 1}).status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    assert _sleep_gauge(server) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "asleep" in r.json()["error"]["message"]
    assert server.post("/sleep", params={"level": 1}).status_code == 400  # asleep already
    assert server.post("/wake_up").status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_gauge(server)["awake"] == 1
    assert _complete(server) == before


def test_bad_level_and_prefix_reset(server) -> None:
    r = server.post("/sleep", params={"level": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    _complete(server)
    assert server.post("/reset_prefix_cache").status_code == 200


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


def test_bad_requests_are_400s(server, tmp_path) -> None:
    r = server.post("/collective_rpc", json={"method": "load_model"})
    assert r.status_code == 400 and "load_model" in r.json()["error"]["message"]
    r = server.post("/collective_rpc", json={"method": "weights_checksum", "args": [1]})
    assert r.status_code == 400 and "weights_checksum" in r.json()["error"]["message"]
    r = server.post("/collective_rpc", json={"method": "sleep", "kwargs": {"depth": 2}})
    assert r.status_code == 400 and "sleep" in r.json()["error"]["message"]
    assert server.post("/collective_rpc", json={"args": []}).status_code == 400
    r = server.post("/update_weights_from_path", json={"path": str(tmp_path / "absent")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    info = server.post("/collective_rpc", json={"method": "rank_info"}).json()["results"]
    assert [i["rank"] for i in info] == [0] and info[0]["sleeping"] is False


def test_update_while_running_is_a_409(server, checkpoints) -> None:
    stream = Stream(server)
    r = server.post("/update_weights_from_path", json={"path": str(checkpoints[1])})
    assert r.status_code == 409 and "idle" in r.json()["error"]["message"]
    assert server.post("/pause").status_code == 200  # (ends the stream)
    stream.join(30)
    assert server.post("/resume").status_code == 200


def test_pause_update_resume(server, checkpoints) -> None:
    before, _ = _cached_complete(server)
    assert before == _hf_tokens(checkpoints[0])
    assert _cached_complete(server) == (before, 32)  # the prompt's full blocks are cached
    old = _checksum(server)
    assert len(old) == 1
    # the pause keeps the cache: the update is what empties it
    assert server.post("/pause", params={"clear_cache": "false"}).status_code == 200
    r = server.post("/update_weights_from_path", json={"path": str(checkpoints[1])})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_tensors"] > 0 and body["weights_checksum"] != old
    assert server.post("/resume").status_code == 200
    assert _checksum(server) == body["weights_checksum"]
    want = _hf_tokens(checkpoints[1])
    assert want != before
    assert _cached_complete(server) == (want, 0)
    assert _cached_complete(server) == (want, 32)


def test_routes_absent_without_dev_mode(monkeypatch) -> None:
    from shoal.entrypoints.openai.dev_routes import add_dev_routes

    for name in ("VLLM_SERVER_DEV_MODE", "SHOAL_SERVER_DEV_MODE"):
        monkeypatch.delenv(name, raising=False)
    app = FastAPI()
    add_dev_routes(app, engine=None)  # type: ignore[arg-type]
    client = TestClient(app)
    assert client.post("/collective_rpc", json={"method": "weights_checksum"}).status_code == 404
    assert client.post("/update_weights_from_path", json={"path": "/"}).status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    add_dev_routes(app, engine=None)  # type: ignore[arg-type]
    paths = {getattr(route, "path", None) for route in app.routes}
    assert {"/collective_rpc", "/update_weights_from_path"} <= paths
