"""`python -m shoal.entrypoints.openai.run_batch`: an OpenAI batch file through shoal.LLM."""

from __future__ import annotations

import json
import subprocess
import sys

from shoal.cli import main as cli_main
from shoal.entrypoints.cli_args import engine_args_from
from shoal.entrypoints.openai import run_batch

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
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
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
