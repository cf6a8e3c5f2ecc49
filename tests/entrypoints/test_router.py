"""`shoal router` in front of two real CPU servers (a tiny random Llama with SmolLM2's
tokenizer) publishing KV events: a repeated long prompt goes back to the backend that cached
it, whose prefix-cache hit counter rises while the other's does not; distinct prompts spread
over both; streams pass through; a backend's reset clears its blocks from the index."""

from __future__ import annotations

import functools
import json
import time

import httpx
import pytest
from oracle import write_tiny_checkpoint

from .conftest import ProxyProcess, RemoteServer, free_port, start_together

pytestmark = pytest.mark.slow

BASE = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512", "--dtype",
        "float32"]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def _prompt(seed: int, n_words: int = 90) -> str:
    """A prompt of several 16-token blocks whose first block differs from every other seed's."""
    head = f"Request {seed} {WORDS[seed % 24]} {seed * 7919}:"
    return head + " " + " ".join(WORDS[(seed * 5 + 3 * i) % 24] for i in range(n_words))


class RouterProc(ProxyProcess):
    def __init__(self, *args: str):
        super().__init__("router", *args)

    def state(self) -> list[dict]:
        return httpx.get(self.url + "/router/state", timeout=10).json()["backends"]

    def complete(self, prompt: str, **kw) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_gguf):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("router") / "m", "llama", seed=0,
                                  vocab_size=49152)
    folder, name = smollm_gguf
    servers, events, starts = [], [], []
    try:
        for _ in range(2):
            pub, replay = free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://127.0.0.1:{pub}",
                   "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
            starts.append(functools.partial(
                RemoteServer, str(model), "--tokenizer", f"{folder}/{name}",
                "--kv-events-config", json.dumps(cfg), base_args=BASE,
                env={"VLLM_SERVER_DEV_MODE": "1"}))
            events += ["--kv-events", f"tcp://127.0.0.1:{pub}",
                       "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]
        servers += start_together(*starts)
        args = [a for s in servers for a in ("--backend", s.base_url)]
        router = RouterProc(*args, *events)
        yield router, servers
        router.stop()
    finally:
        for s in servers:
            s.stop()


def _wait_indexed(router: RouterProc, backend: int, at_least: int) -> None:
    deadline = time.monotonic() + 10
    while router.state()[backend]["cached_blocks"] < at_least:
        assert time.monotonic() < deadline, router.state()
        time.sleep(0.1)


def test_repeated_prefix_goes_to_the_backend_that_holds_it(cluster) -> None:
    router, servers = cluster
    first = router.complete(_prompt(1))
    assert first.status_code == 200, first.text
    owner = [s.base_url for s in servers].index(first.headers["x-shoal-backend"])
    other = 1 - owner
    _wait_indexed(router, owner, 4)  # its blocks' events reached the router
    hits = [s.metric("prefix_cache_hits_total") for s in servers]
    for _ in range(3):
        again = router.complete(_prompt(1) + " and more", max_tokens=1)
        assert again.status_code == 200 and again.headers["x-shoal-backend"] == \
            servers[owner].base_url
    want = hits[owner] + 3 * 64  # each repeat hits at least 4 blocks of 16 tokens
    got = servers[owner].wait_metric("prefix_cache_hits_total", lambda v: v >= want)
    assert got >= want
    assert servers[other].metric("prefix_cache_hits_total") == hits[other]
    assert router.state()[owner]["prefix_routed"] >= 3


def test_distinct_prompts_spread_over_both_backends(cluster) -> None:
    router, servers = cluster
    before = [b["routed"] for b in router.state()]
    for seed in range(10, 16):
        assert router.complete(_prompt(seed, 20)).status_code == 200
    routed = [b["routed"] - n for b, n in zip(router.state(), before)]
    assert routed == [3, 3]


def test_chat_stream_passes_through_and_reset_clears_the_index(cluster) -> None:
    router, servers = cluster
    body = {"messages": [{"role": "user", "content": _prompt(30)}], "max_tokens": 3,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        owner = [s.base_url for s in servers].index(r.headers["x-shoal-backend"])
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    _wait_indexed(router, owner, 4)
    r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": False},
                   timeout=120)
    assert r.headers["x-shoal-backend"] == servers[owner].base_url
    assert servers[owner].post("/reset_prefix_cache").status_code == 200
    # the reset's event goes out with the next step: any request to that backend
    servers[owner].post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    deadline = time.monotonic() + 10
    while router.state()[owner]["cached_blocks"] > 1:
        assert time.monotonic() < deadline, router.state()
        time.sleep(0.1)
    bad = httpx.post(router.url + "/v1/completions", content=b"{", timeout=10)
    assert bad.status_code == 400
