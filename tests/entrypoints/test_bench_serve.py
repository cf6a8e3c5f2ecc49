"""`shoal bench serve` against a real `shoal serve` (the embedded model): exact counts."""

from __future__ import annotations

import json

import pytest

from shoal.benchmarks.datasets import RandomSpec, sample_random
from shoal.cli import main

from .conftest import RemoteServer


@pytest.fixture(scope="module")
def server(smollm2_server) -> RemoteServer:
    return smollm2_server  # the package's shared server (conftest)


@pytest.mark.parametrize("stream", [True, False])
def test_counts_are_exact_with_ignore_eos(server, tmp_path, stream):
    args = ["bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
            "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio",
            "0.5", "--num-prompts", "5", "--max-concurrency", "3", "--ignore-eos",
            "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    # Non-streaming also sends token ids, with no client tokenizer (exact input lengths).
    assert main(args + ([] if stream else ["--non-streaming", "--skip-tokenizer-init"])) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 5 and res["failed"] == 0
    # Text prompts built with the server's own tokenizer (resolved from /v1/models) come
    # back with the lengths asked for; ignore_eos makes every output exactly as long.
    spec = RandomSpec.from_ratio(12, 6, 0.5, token_range=(0, 10000), token_ids=True)
    wanted = [r.expected_output_len for r in sample_random(spec, 5, seed=0)]  # same draws
    assert res["output_lens"] == wanted and all(3 <= n <= 9 for n in wanted)
    assert res["total_output_tokens"] == sum(res["output_lens"])
    wanted_in = [r.prompt_len for r in sample_random(spec, 5, seed=0)]
    if stream:
        assert all(6 <= n <= 18 for n in res["input_lens"])
    else:
        assert res["input_lens"] == wanted_in
    assert res["total_input_tokens"] == sum(res["input_lens"])
    assert res["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    if stream:
        assert [len(i) for i in res["itls"]] == [n - 1 for n in res["output_lens"]]
        assert res["mean_ttft_ms"] < res["mean_e2el_ms"]
    else:
        assert res["mean_ttft_ms"] == pytest.approx(res["mean_e2el_ms"])
    assert server.metric("request_success_total") >= 5
