"""`python -m shoal.entrypoints.openai.run_batch`: an OpenAI batch file through shoal.LLM;
its metrics server (--enable-metrics --host --port) and /v1/embeddings lines."""

from __future__ import annotations

import argparse
import base64
import json
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import shoal.llm
from shoal.cli import main as cli_main
from shoal.engine.request_checks import wrong_runner_message
from shoal.entrypoints.cli_args import add_run_batch_args, engine_args_from
from shoal.entrypoints.openai import run_batch

from .conftest import free_port

LINES = [
    {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}},
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2,
              "temperature": 0, "logprobs": True, "top_logprobs": 2}},
    {"custom_id": "score", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Paris is in France", "max_tokens": 0, "echo": True, "logprobs": 0}},
    {"custom_id": "refused", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}},
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/audio/transcriptions",
     "body": {"input": "x"}},
    {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": [1] * 300, "max_tokens": 1}},
    {"custom_id": "choice", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Pick one:", "max_tokens": 5, "guided_choice": ["left", "right"]}},
    {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 60,
              "temperature": 0, "tool_choice": "required", "tools": [{
                  "type": "function", "function": {"name": "w", "parameters": {
                      "type": "object", "properties": {"c": {"enum": ["a", "b"]}},
                      "required": ["c"]}}}]}},
    {"custom_id": "bad-regex", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "(?=a)b"}}},
]


FLAGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(32 * 2**20)]


def test_run_batch_file(tmp_path):
    """The module's spelling, end to end (the CLI's is the same runner: the test below)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    proc = subprocess.run([sys.executable, "-m", "shoal.entrypoints.openai.run_batch",
                           "-i", str(src), "-o", str(dst), *FLAGS],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in LINES]
    by_id = {o["custom_id"]: o["response"] for o in out}
    cmpl = by_id["cmpl"]["body"]
    assert by_id["cmpl"]["status_code"] == 200 and cmpl["object"] == "text_completion"
    assert cmpl["usage"]["completion_tokens"] == 3
    chat = by_id["chat"]["body"]["choices"][0]
    assert len(chat["logprobs"]["content"]) == 2
    score = by_id["score"]["body"]["choices"][0]
    assert score["text"] == "Paris is in France" and score["logprobs"]["token_logprobs"][0] is None
    assert by_id["choice"]["body"]["choices"][0]["text"] in ("left", "right")
    call = by_id["tool"]["body"]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "w" and json.loads(call["arguments"])["c"] in ("a", "b")
    for cid, param in (("refused", "use_beam_search"), ("bad-url", None), ("too-long", None),
                       ("bad-regex", None)):
        assert by_id[cid]["status_code"] == 400, by_id[cid]
        err = by_id[cid]["body"]["error"]
        assert err["code"] == 400 and (param is None or err["param"] == param)


def test_the_cli_spelling_runs_the_same_batch(tmp_path, monkeypatch, capsys):
    """`shoal run-batch` (vLLM's other spelling) hands the runner what the module's parser
    does; and its runner really runs: a missing input file is its error, before any model."""
    argv = ["-i", "in.jsonl", "-o", "out.jsonl", *FLAGS]
    seen = []
    with monkeypatch.context() as m:
        m.setattr(run_batch, "run_from", lambda ns: seen.append(ns) or 0)
        assert cli_main(["run-batch", *argv]) == 0 and run_batch.main(argv) == 0
    cli, module = seen
    assert (cli.input_file, cli.output_file) == (module.input_file, module.output_file) == (
        "in.jsonl", "out.jsonl")
    assert engine_args_from(cli) == engine_args_from(module)
    missing, dst = tmp_path / "missing.jsonl", tmp_path / "out.jsonl"
    assert cli_main(["run-batch", "-i", str(missing), "-o", str(dst), *FLAGS]) == 2
    assert "run_batch: error" in capsys.readouterr().err and not dst.exists()


# ---- --enable-metrics (vLLM's run_batch flags) and /v1/embeddings lines --------------------------

def _sample_sum(text: str, name: str) -> tuple[float, int]:
    """The value of a sample summed over its label sets, and how many there were."""
    total, count = 0.0, 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                total, count = total + s.value, count + 1
    return total, count


def test_metrics_server_lives_with_the_batch(smollm_llm, tmp_path, monkeypatch):
    """`--enable-metrics --host H --port P`: the Prometheus server answers while the model
    loads (before any series exist), shows the batch's vllm: series (request, token and
    latency counts equal to the output's usage) after it ran, and is gone when the runner
    returns; the engine records nothing afterwards (the shared LLM is left as it was)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict[str, object] = {}

    def loading(**engine_args):  # the LLM the runner builds: the session's one
        seen["while_loading"] = httpx.get(url + "/", timeout=5).status_code
        return smollm_llm

    real_run = run_batch.run

    def run_then_scrape(lines, llm, name):
        out = real_run(lines, llm, name)
        seen["metrics"] = httpx.get(url + "/metrics", timeout=5).text
        return out

    monkeypatch.setattr(shoal.llm, "LLM", loading)
    monkeypatch.setattr(run_batch, "run", run_then_scrape)
    lines = [LINES[0], LINES[1],
             {"custom_id": "cmpl2", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": ["One, two,", "Hello"], "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True}},
             {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": "You are a helpful assistant."}}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run_batch.main(["-i", str(src), "-o", str(dst), "--enable-metrics", "--host",
                           "127.0.0.1", "--port", str(port), *FLAGS]) == 0
    out = {o["custom_id"]: o["response"] for o in map(json.loads, dst.read_text().splitlines())}
    assert seen["while_loading"] == 200
    # an embeddings line to a generative model: the server's 400, the batch runs on
    assert out["embed"]["status_code"] == 400
    assert out["embed"]["body"]["error"]["message"] == wrong_runner_message(False)
    usages = [out[c]["body"]["usage"] for c in ("cmpl", "chat", "cmpl2")]
    text = str(seen["metrics"])
    assert _sample_sum(text, "vllm:request_success_total")[0] == 4  # cmpl2 has two prompts
    assert _sample_sum(text, "vllm:e2e_request_latency_seconds_count")[0] == 4
    assert _sample_sum(text, "vllm:prompt_tokens_total")[0] == sum(
        u["prompt_tokens"] for u in usages)
    assert _sample_sum(text, "vllm:generation_tokens_total")[0] == sum(
        u["completion_tokens"] for u in usages) == 3 + 2 + 2 * 4
    assert _sample_sum(text, "vllm:cache_config_info")[1] == 1
    assert "shoal:request_success_total" in text
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/", timeout=2)
    assert "process_outputs" not in vars(smollm_llm.llm_engine.outputs)


def test_metrics_flags_parse_and_a_taken_port_is_an_error(tmp_path, capsys):
    """vLLM's --enable-metrics --host --port in both spellings; a port in use fails the
    runner before any model loads."""
    argv = ["-i", "in.jsonl", "-o", "out.jsonl", "--enable-metrics", "--host", "0.0.0.0",
            "--port", "9123"]
    p = argparse.ArgumentParser()
    add_run_batch_args(p)
    ns = p.parse_args(argv)
    assert (ns.enable_metrics, ns.host, ns.port) == (True, "0.0.0.0", 9123)
    defaults = p.parse_args(argv[:4])
    assert (defaults.enable_metrics, defaults.host, defaults.port) == (False, "127.0.0.1", 8000)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(LINES[0]) + "\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_main(["run-batch", "-i", str(src), "-o", str(dst), "--enable-metrics",
                         "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert "run_batch: error" in capsys.readouterr().err and not dst.exists()


@pytest.fixture(scope="module")
def minilm():
    from shoal import LLM

    return LLM("all-MiniLM-L6-v2")


def test_embeddings_lines(minilm):
    """/v1/embeddings lines on an embedding model: the server's body (float and base64 equal
    to LLM.embed's vectors, usage the tokens read); a bad line (dimensions on a model
    without Matryoshka dimensions, an empty input, a generation request) is its 400 alone."""
    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    lines = [
        {"custom_id": "float", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "all-MiniLM-L6-v2", "input": texts}},
        {"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": texts[1], "encoding_format": "base64"}},
        {"custom_id": "dims", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "x", "dimensions": 8}},
        {"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 2}},
    ]
    out = {o["custom_id"]: o["response"]
           for o in run_batch.run([json.dumps(x) for x in lines], minilm, "all-MiniLM-L6-v2")}
    offline = minilm.embed(texts, use_tqdm=False)
    want = [o.outputs.embedding for o in offline]
    body = out["float"]["body"]
    assert out["float"]["status_code"] == 200 and body["object"] == "list"
    assert body["model"] == "all-MiniLM-L6-v2" and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert {d["object"] for d in body["data"]} == {"embedding"}
    assert [d["embedding"] for d in body["data"]] == want  # bit for bit
    tokens = sum(len(o.prompt_token_ids) for o in offline)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    b64 = out["b64"]["body"]["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(b64), "<f4").tolist() == want[1]
    for cid in ("dims", "empty", "cmpl"):
        assert out[cid]["status_code"] == 400, out[cid]
        assert out[cid]["body"]["error"]["code"] == 400
    assert out["cmpl"]["body"]["error"]["message"] == wrong_runner_message(True)
