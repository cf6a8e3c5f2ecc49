"""benchmarks/step_profile_gpu.py's arithmetic (and trace_charges.py's), without an engine (its --smoke run takes
longer than the suite's budget allows): kernels charged to the ranges open at their launch
in a hand-made Chrome trace of the GPU's form (launch and kernel matched by correlation id),
the decode steps picked out with their sampling, module kinds, and the dense floor of the
shipped Llama-3.1-8B shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tc(prof):
    import trace_charges  # (on the path with step_profile_gpu, which imports it)

    return trace_charges


def _range(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": "shoal::" + name, "pid": 1,
            "tid": tid, "ts": ts, "dur": dur}


def _launch(corr: int, ts: float, tid: int = 1, cat: str = "cuda_runtime") -> list[dict]:
    """A launch on the CPU thread and its kernel k<corr % 3> of corr us (later, on the GPU
    stream)."""
    return [{"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "pid": 1, "tid": tid,
             "ts": ts, "dur": 1, "args": {"correlation": corr}},
            {"ph": "X", "cat": "kernel", "name": f"k{corr % 3}", "pid": 0, "tid": 7,
             "ts": 1000 + corr, "dur": float(corr), "args": {"correlation": corr}}]


def test_kernels_are_charged_to_the_innermost_range_of_their_launch(tc) -> None:
    events = [
        _range("step 0 t=16", 0, 100), _range("model", 5, 90), _range("experts", 30, 30),
        _range("sample 0 t=16", 100, 20),
        _range("step 1 t=1", 200, 100), _range("model", 205, 90),
        _range("attention_linears", 210, 10), _range("experts", 230, 30),
        _range("router", 231, 5),  # nested inside experts (innermost wins)
        _range("sample 1 t=1", 300, 20),
        _range("step 2 t=1", 400, 50),
        _range("experts", 400, 10, tid=2),  # another thread's range: not around tid 1
    ]
    events += _launch(1, 40)  # prefill experts
    events += _launch(2, 215) + _launch(3, 232) + _launch(4, 240, cat="cuda_driver")
    events += _launch(5, 250) + _launch(6, 270) + _launch(7, 310) + _launch(8, 401)
    events += [{"ph": "X", "cat": "kernel", "name": "orphan", "pid": 0, "tid": 7, "ts": 5000,
                "dur": 100.0, "args": {"correlation": 99}},
               {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1}]
    charges = {c.name + str(c.us): c.ranges for c in tc.charges({"traceEvents": events})}
    assert charges["k03.0"] == ["step 1 t=1", "model", "experts", "router"]
    assert charges["k28.0"] == ["step 2 t=1"]  # tid 2's experts range is not its thread's
    assert charges["orphan100.0"] == ["step 2 t=1", "unattributed"]  # after k2 on its stream
    events = [e for e in events if e.get("name") != "orphan"]
    fig = tc.decode_figures(tc.charges({"traceEvents": events}), 1, top=2)
    assert fig.steps == 2 and fig.kernels_per_step == 3.5  # kernels 2..8 over steps 1, 2
    assert fig.us_per_step == (2 + 3 + 4 + 5 + 6 + 7 + 8) / 2
    kinds = {k: (v["us"] * 2, v["kernels"] * 2) for k, v in fig.by_kind.items()}
    assert kinds == {"attention_linears": (2, 1), "router": (3, 1), "experts": (4 + 5, 2),
                     "other_model": (6, 1), "sampling": (7, 1), "other_step": (8, 1)}
    # kernels by name: k0 (3, 6), k2 (2, 5, 8), k1 (4, 7), the top two by time a step
    assert [(k["name"], k["calls_per_step"] * 2, k["us_per_step"] * 2)
            for k in fig.by_kernel] == [("k2", 3, 15.0), ("k1", 2, 11.0)]


def test_module_kinds_follow_the_layer_classes_and_names(prof) -> None:
    def module(cls: str):
        return type(cls, (), {})()

    kinds = {(n, c): prof.module_kind(n, module(c)) for n, c in [
        ("model.layers.0.mlp.experts", "FusedMoE"), ("model.layers.0.mlp.router", "GptOssRouter"),
        ("model.layers.0.mlp.gate", "ReplicatedLinear"),
        ("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
        ("model.layers.0.self_attn.attn", "Attention"),
        ("model.layers.0.self_attn", "GptOssAttention"),
        ("model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear"),
        ("model.layers.0.mlp.act", "SiluAndMul"), ("model.norm", "RMSNorm"),
        ("model.embed_tokens", "VocabParallelEmbedding"), ("lm_head", "ParallelLMHead"),
        ("model.layers.0", "GptOssDecoderLayer")]}
    assert list(kinds.values()) == ["experts", "router", "router", "attention_linears",
                                    "attention_kernel", None, "mlp_linears", "activation",
                                    "norms", "embedding", None, None]


def test_dense_floor_of_the_shipped_llama_8b_shape(prof) -> None:
    """q/k/v/o 2.68 GB, gate/up/down 11.27 GB, LM head 1.05 GB: 15.0 GB a token (gpu_suite's
    W2 figure), 200 tok/s at the H100's 3.0 TB/s."""
    cfg = json.loads((ROOT / "shoal/model_configs/llama-3.1-8b/config.json").read_text())
    table = prof.floor_table(cfg, 2, 3.0e12, None)
    parts = {p["part"]: p["bytes"] for p in table["parts"]}
    assert parts["attention"] == 32 * (4096 * 6144 + 4096 * 4096) * 2
    assert parts["mlp"] == 32 * 3 * 4096 * 14336 * 2
    assert 14.9e9 < table["bytes_per_token"] < 15.1e9
    assert table["floor_tok_s"] == pytest.approx(3.0e12 / table["bytes_per_token"])
    moe = json.loads((ROOT / "shoal/model_configs/qwen3-30b-a3b/config.json").read_text())
    assert prof.floor_table(moe, 2, 3.0e12, None)["parts"] == []
