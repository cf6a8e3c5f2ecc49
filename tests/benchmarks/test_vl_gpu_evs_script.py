"""benchmarks/vl_gpu.py's evs section for Qwen3-VL at --smoke size on the CPU (a tiny random
Qwen3-VL, one engine per rate): video tokens and TTFT at rates 0 and 0.5, half the video
tokens at 0.5; and the word-level tokenizer the GPU run writes splits Qwen3-VL's frame
timestamps into Qwen's six pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu_script
def test_vl_gpu_smoke_evs_qwen3_vl(tmp_path: Path) -> None:
    out = tmp_path / "evs.json"
    env = {**os.environ, "SHOAL_COMMIT": "test"}
    env.pop("SHOAL_BENCH_PUBLIC_ONLY", None)
    proc = subprocess.run([sys.executable, "benchmarks/vl_gpu.py", "--smoke", "--sections",
                           "evs", "--model", "Qwen/Qwen3-VL-8B-Instruct", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    assert rec["workload"] == "W13_evs" and "error" not in rec and "skipped" not in rec
    rates = {r["rate"]: r for r in rec["rates"]}
    assert set(rates) == {0.0, 0.5}
    for r in rates.values():
        assert r["requests"] == 1 and r["engine_ttft_ms_median"] > 0
        assert r["wall_ttft_ms_median"] >= r["engine_ttft_ms_median"]
    # 4 frames of 112x84 -> 2 groups of 2 x 3 merged patches; EVS keeps half
    assert rates[0.0]["video_tokens"] == 12 and rates[0.5]["video_tokens"] == 6
    assert rates[0.5]["tokens_over_rate0"] == 0.5
    assert rates[0.5]["engine_ttft_over_rate0"] > 0
    # the prompts differ by the pruned pads only (timestamps and text kept)
    assert rates[0.0]["prompt_tokens"] - rates[0.5]["prompt_tokens"] == 6


def test_word_tokenizer_splits_timestamps(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vl_gpu
    finally:
        sys.path.pop(0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_gpu.qwen_word_tokenizer(tmp_path / "tok")))
    first = vl_gpu.TIMESTAMP_FIRST_ID
    piece = {p: first + k for k, p in enumerate(vl_gpu.TIMESTAMP_PIECES)}
    assert tok.encode("<2.5 seconds>", add_special_tokens=False) == [
        piece["<"], piece["2"], piece["."], piece["5"], piece["seconds"], piece[">"]]
    # prompt words and special tokens keep their ids
    text = tok.apply_chat_template([{"role": "user", "content": "w12 <|video_pad|> w199"}],
                                   tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == [
        151644, 1, 12, 151656, 199, 151645, 151644, 2]
