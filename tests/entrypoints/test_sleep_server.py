"""`shoal serve` with VLLM_SERVER_DEV_MODE=1: /sleep (level 1), /is_sleeping and /wake_up around
greedy completions (the same tokens after the round trip), requests refused while asleep, the
engine_sleep_state gauge, and /reset_prefix_cache. (Level 2 needs a weight update before the
wake, which the server has no route for yet: tests/rl covers it offline.)"""

from __future__ import annotations

import pytest
from oracle import write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_gguf):
    base = write_tiny_checkpoint(tmp_path_factory.mktemp("sleep"), "llama", seed=0,
                                 vocab_size=49152)
    folder, name = smollm_gguf
    srv = RemoteServer(str(base), "--tokenizer", f"{folder}/{name}", "--dtype", "float32",
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "512"],
                       env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


def _complete(srv) -> list[int]:
    r = srv.post("/v1/completions", json={"prompt": [5, 6, 7, 8, 9] * 8, "max_tokens": 6,
                                          "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _sleep_gauge(srv) -> dict[str, float]:
    out = {}
    for line in srv.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            state = line.split('sleep_state="')[1].split('"')[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


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
