"""The benchmark scripts' shared helpers (benchmarks/): result files, flags, the comparison of
two result folders, the engine-internals switch, and the presets that replaced scripts."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_args  # noqa: E402
import compare_results  # noqa: E402
import engine_internals  # noqa: E402
import results_file  # noqa: E402


def test_record_keeps_the_old_keys_and_names_host_and_versions(monkeypatch):
    monkeypatch.setenv("SHOAL_COMMIT", "abc1234")
    rec = results_file.record("W2", "shoal", output_tok_s=1.5)
    assert list(rec)[:8] == ["workload", "hardware", "commit", "engine", "command", "torch",
                             "transformers", "date"]
    assert rec["commit"] == "abc1234" and rec["output_tok_s"] == 1.5
    assert rec["hardware"] == (results_file.gpu_names() or ("cpu",))[0]
    assert {"cpu", "cores", "isa_flags", "mem_gib", "gpus"} <= set(rec["host"])
    assert rec["versions"]["python"] and rec["versions"].get("shoal")
    assert rec["shoal_source"] and Path(rec["shoal_source"], "shoal").is_dir()


def test_commit_without_override_is_a_sha(monkeypatch):
    monkeypatch.delenv("SHOAL_COMMIT", raising=False)
    sha = results_file.commit(short=True)
    assert sha == "unknown" or len(sha.removesuffix("-dirty")) >= 7


def test_default_path_and_write(tmp_path):
    path = results_file.default_path("W9", "H200", suffix="-x")
    assert path.parent.name == "results" and path.parent.parent.name == "benchmarks"
    assert path.name.endswith("-W9-H200-x.json")
    assert results_file.default_path("W9", "cpu", smoke=True).parent.parent.name == "bench-work"
    out = results_file.write({"a": (1, 2)}, tmp_path / "sub" / "r.json")
    assert json.loads(out.read_text()) == {"a": [1, 2]}


def test_results_file_imports_nothing_heavy():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import results_file as r; "
            "r.record('W1', 'shoal'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


def test_add_common_flags_defaults_and_required():
    p = argparse.ArgumentParser()
    bench_args.add_common(p, out=bench_args.REQUIRED, model="m", repeats=3, smoke="quick")
    ns = p.parse_args(["--out", "x.json"])
    assert (ns.out, ns.model, ns.repeats, ns.smoke) == (Path("x.json"), "m", 3, False)
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert bench_args.comma_ints("1,32,") == [1, 32]
    assert bench_args.comma_floats("0,0.8") == [0.0, 0.8]
    assert bench_args.int_range("100,512") == (100, 512)
    with pytest.raises(argparse.ArgumentTypeError):
        bench_args.int_range("5,1")


def test_compare_results_ratios(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    for folder, tok_s in ((before, 100.0), (after, 110.0)):
        folder.mkdir()
        results_file.write([{"output_tok_s": tok_s, "ready_s": 20.0, "smoke": True,
                             "host": {"cores": 2}, "runs_output_tok_s": [tok_s, tok_s]}],
                           folder / "w1.json")
    rows = {key: ratio for _, key, _, _, ratio in
            compare_results.compare(before, after, compare_results.HEADLINE)}
    assert rows == {"0.output_tok_s": pytest.approx(1.1), "0.ready_s": 1.0,
                    "0.runs_output_tok_s.0": pytest.approx(1.1),
                    "0.runs_output_tok_s.1": pytest.approx(1.1)}
    assert compare_results.main([str(before), str(after), "--markdown"]) == 0
    assert "| w1 | 0.output_tok_s | 100 | 110 | 1.100 |" in capsys.readouterr().out


def test_public_only_hides_the_engine_internals(monkeypatch):
    class Core:
        runner = object()

    class Engine:
        core = Core()

    class FakeLLM:
        llm_engine = Engine()

    assert engine_internals.core(FakeLLM()) is Engine.core
    monkeypatch.setenv("SHOAL_BENCH_PUBLIC_ONLY", "1")
    assert engine_internals.core(FakeLLM()) is None and engine_internals.runner(FakeLLM()) is None
    with pytest.raises(RuntimeError, match="SHOAL_BENCH_PUBLIC_ONLY"):
        engine_internals.core(FakeLLM(), required=True)
    with engine_internals.step_counter(FakeLLM()) as steps:
        assert steps is None


def test_method_timers_wrap_and_restore():
    class Thing:
        def work(self, x):
            return x + 1

    thing = Thing()
    timers = engine_internals.MethodTimers()
    timers.wrap(thing, "work")
    assert thing.work(1) == 2 and thing.work(2) == 3
    assert len(timers.calls["work"]) == 2 and timers.sums()["work"] >= 0
    timers.restore()
    assert "work" not in vars(thing) and thing.work(1) == 2


def test_w3_preset_replaces_the_gpu_suite_part():
    from shoal.benchmarks.offline_common import apply_preset
    from shoal.benchmarks.presets import THROUGHPUT_PRESETS
    from shoal.cli import build_parser

    ns = build_parser().parse_args(["bench", "throughput", "--preset", "W3"])
    preset = apply_preset(ns, THROUGHPUT_PRESETS)
    assert (ns.model, ns.load_format, ns.dtype, ns.max_model_len, ns.temperature) == (
        "meta-llama/Llama-3.1-8B", "dummy", "bfloat16", 2048, 0.0)
    assert preset.num_prompts == 1024 and preset.random.input_range == (1000, 1000)


def test_pp_cpu_preset_replaces_the_pp_microbatch_script():
    from shoal.benchmarks.offline_common import apply_preset
    from shoal.benchmarks.presets import THROUGHPUT_PRESETS
    from shoal.cli import build_parser

    ns = build_parser().parse_args(["bench", "throughput", "--preset", "pp-cpu",
                                    "--pipeline-parallel-size", "2"])
    preset = apply_preset(ns, THROUGHPUT_PRESETS)
    assert (ns.pipeline_parallel_size, ns.max_model_len, ns.temperature) == (2, 512, 0.0)
    assert preset.num_prompts == 32 and preset.random.token_range == (0, 49000)
