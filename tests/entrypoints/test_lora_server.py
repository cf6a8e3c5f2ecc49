"""`shoal serve --enable-lora` over a tiny random Llama (SmolLM2's tokenizer): adapters named by
`model` give PEFT's greedy tokens, four adapters and the base at once with fewer device slots
than adapters; /v1/models lists them with their parent; adapters loaded and unloaded at run
time; bad adapters answered 400/404 while the others keep serving; vLLM's LoRA gauge."""

from __future__ import annotations

import concurrent.futures

import pytest
from lora import peft_adapters  # tests/lora
from oracle import hf_greedy, write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow

PROMPTS = [[17, 2034, 330, 4023, 9, 88, 1500], [600, 601, 602, 99, 14, 3]]
STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_gguf):
    root = tmp_path_factory.mktemp("lora-server")
    base = write_tiny_checkpoint(root / "base", "llama", seed=0, vocab_size=49152)
    adapters = {f"ad{i}": peft_adapters.write_adapter(base, root / f"ad{i}", seed=10 + i,
                                                      r=4 + 4 * (i % 2))
                for i in range(5)}
    big = peft_adapters.write_adapter(base, root / "big", seed=3, r=16)
    other = write_tiny_checkpoint(root / "other", "llama", seed=1, vocab_size=49152,
                                  hidden_size=32, intermediate_size=64)
    wrong = peft_adapters.write_adapter(other, root / "wrong", seed=4)
    folder, name = smollm_gguf
    modules = [f"{n}={p}" for n, p in list(adapters.items())[:4]]
    srv = RemoteServer(str(base), "--tokenizer", f"{folder}/{name}", "--dtype", "float32",
                       "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                       "--max-cpu-loras", "3", "--lora-modules", *modules,
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "512"],
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield srv, base, adapters, {"big": big, "wrong": wrong, "root": root}
    srv.stop()


def _oracle(base, adapter) -> list[list[int]]:
    model = peft_adapters.peft_model(base, adapter)
    return [hf_greedy(model, p, STEPS)[0] for p in PROMPTS]


def _tokens(srv, model: str) -> list[list[int]]:
    r = srv.post("/v1/completions", json={
        "model": model, "prompt": PROMPTS, "max_tokens": STEPS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_models_lists_adapters_with_parent(setup) -> None:
    srv, base, adapters, _ = setup
    cards = {m["id"]: m for m in srv.get("/v1/models").json()["data"]}
    assert {f"ad{i}" for i in range(4)} <= set(cards)
    assert cards["ad0"]["parent"] == str(base) and cards["ad0"]["root"] == str(adapters["ad0"])
    assert srv.get("/v1/models/ad1").json()["parent"] == str(base)


def test_adapters_and_base_at_once_match_peft(setup) -> None:
    """Four adapters and the base in flight together, over two device slots."""
    srv, base, adapters, _ = setup
    names = [str(base), "ad0", "ad1", "ad2", "ad3"]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = dict(zip(names, pool.map(lambda n: _tokens(srv, n), names)))
    for n in names:
        assert got[n] == _oracle(base, adapters.get(n)), n
    assert len({str(v) for v in got.values()}) == len(names)  # every adapter changes tokens


def test_chat_stream_by_adapter_name(setup) -> None:
    srv, _, _, _ = setup
    client = srv.openai()
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="ad2", messages=msgs, max_tokens=6,
                                          temperature=0)
    stream = client.chat.completions.create(model="ad2", messages=msgs, max_tokens=6,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content and full.model == "ad2"


def test_load_and_unload_at_run_time(setup) -> None:
    srv, base, adapters, _ = setup
    r = srv.post("/v1/load_lora_adapter", json={"lora_name": "late",
                                                 "lora_path": str(adapters["ad4"])})
    assert r.status_code == 200 and "added successfully" in r.text
    assert _tokens(srv, "late") == _oracle(base, adapters["ad4"])
    r = srv.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    r = srv.post("/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # the same name again, now another folder: its own tokens, nothing of the old one cached
    r = srv.post("/v1/load_lora_adapter", json={"lora_name": "late",
                                                 "lora_path": str(adapters["ad0"])})
    assert r.status_code == 200
    assert _tokens(srv, "late") == _oracle(base, adapters["ad0"])


@pytest.mark.parametrize("case, status, needle", [
    ("missing", 400, "does not exist"),
    ("big", 400, "max_lora_rank"),
    ("wrong", 400, "another base model"),
    ("duplicate", 400, "already been loaded"),
    ("no_json", 400, "JSON object"),
])
def test_bad_adapters_are_refused(setup, case, status, needle) -> None:
    srv, base, adapters, extra = setup
    body = {"missing": {"lora_name": "m", "lora_path": str(extra["root"] / "nope")},
            "big": {"lora_name": "b", "lora_path": str(extra["big"])},
            "wrong": {"lora_name": "w", "lora_path": str(extra["wrong"])},
            "duplicate": {"lora_name": "ad0", "lora_path": str(adapters["ad0"])}}.get(case)
    r = (srv.post("/v1/load_lora_adapter", json=body) if body is not None else
         srv.post("/v1/load_lora_adapter", content=b"[1, 2]"))
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert _tokens(srv, "ad1") == _oracle(base, adapters["ad1"])  # still serving


def test_unload_unknown_is_404(setup) -> None:
    srv, _, _, _ = setup
    r = srv.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


def test_lora_requests_info_gauge(setup) -> None:
    srv, _, _, _ = setup
    lines = [ln for ln in srv.get("/metrics").text.splitlines()
             if ln.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]
