"""The weight-only decode GEMVs (shoal/layers/quantization/decode_gemv.py) against plain
PyTorch (weights dequantized to float32, one float32 matmul), in Triton's interpreter on the
CPU (conftest.py): every launch shape the CPU candidate lists hold plus split-K ones, odd M, N
and K, block scales, asymmetric zero points; then the layers' wiring through the launch tuner
(a timed choice is replayed, the CPU keeps the heuristic's pick)."""

from __future__ import annotations

import pytest
import torch

from shoal.layers.quantization import decode_gemv, launch_tuner
from shoal.layers.quantization.decode_gemv import GemvTiles, fp8_gemv, int4_gemv
from shoal.layers.quantization.methods import make_quant_linear
from shoal.quantization.packed import dequantize_packed, quantize_fp8, quantize_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got.float() - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-6, (err, want.abs().max().item())


@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 40, 200, GemvTiles(16, 32, 1)),  # partial strip and K step
    (3, 64, 512, GemvTiles(8, 16, 4)),  # K split over programs, odd M
    (8, 24, 96, GemvTiles(32, 64, 2)),  # the most rows; a split with one short step
    (1, 6, 2500, GemvTiles(4, 1024, 1)),  # ONE_ROW_LONG_STEPS: a short last step and strip
    (1, 8, 4200, GemvTiles(4, 2048, 2)),
])
@pytest.mark.parametrize("early", [False, True])
def test_fp8_gemv_per_row_scales(m, n, k, tiles, early):
    """early: the first K step peeled off (its weights read before PDL's wait; here without
    PDL), for one row; more rows ignore it."""
    torch.manual_seed(0)
    p = quantize_fp8(torch.randn(n, k, device=DEVICE))
    x = torch.randn(m, k, device=DEVICE)
    got = fp8_gemv(x, p.parts["weight"], p.parts["scale"].reshape(n).contiguous(), tiles,
                   early=early)
    _close(got, x @ dequantize_packed(p).t())


@pytest.mark.parametrize("m,scale_rows,tiles", [(2, 1, GemvTiles(16, 32, 1)),
                                                (1, 16, GemvTiles(8, 16, 3))])
def test_fp8_gemv_block_scales(m, scale_rows, tiles):
    torch.manual_seed(1)
    n, k, group = 48, 160, 32  # K ends mid-group
    p = quantize_fp8(torch.randn(n, k, device=DEVICE), (16, group))
    scale = p.parts["scale"]
    if scale_rows > 1:
        scale = scale[::scale_rows].contiguous()
    x = torch.randn(m, k, device=DEVICE)
    got = fp8_gemv(x, p.parts["weight"], scale, tiles, group=group, scale_rows=scale_rows)
    _close(got, x @ dequantize_packed(p).t())


@pytest.mark.parametrize("m,n,k,group,sym,tiles", [
    (1, 40, 256, 32, True, GemvTiles(16, 32, 1)),
    (3, 24, 200, 32, False, GemvTiles(32, 8, 4)),  # zero points, K ends mid-group, split
    (5, 16, 100, -1, False, GemvTiles(16, 64, 2)),  # per channel; K not a multiple of 8
    (8, 64, 256, 128, True, GemvTiles(64, 128, 1)),
])
def test_int4_gemv(m, n, k, group, sym, tiles):
    torch.manual_seed(2)
    p = quantize_int4(torch.randn(n, k, device=DEVICE), group, sym)
    x = torch.randn(m, k, device=DEVICE)
    zeros = None if sym else p.parts["zero"].t().contiguous()
    got = int4_gemv(x, p.parts["codes"].t().contiguous(), p.parts["scale"].t().contiguous(),
                    zeros, p.group, tiles)
    _close(got, x @ dequantize_packed(p).t())


def test_bad_launches_are_refused_by_name():
    p = quantize_int4(torch.randn(16, 64), 32)
    args = (p.parts["codes"].t().contiguous(), p.parts["scale"].t().contiguous(), None, 32)
    with pytest.raises(ValueError, match="1..8 rows"):
        int4_gemv(torch.randn(9, 64), *args, GemvTiles(16, 32, 1))
    with pytest.raises(ValueError, match="divides the group"):
        int4_gemv(torch.randn(1, 64), *args, GemvTiles(16, 64, 1))
    f = quantize_fp8(torch.randn(16, 64), (16, 32))
    with pytest.raises(ValueError, match="must divide the group"):
        fp8_gemv(torch.randn(1, 64), f.parts["weight"], f.parts["scale"], GemvTiles(16, 48, 1),
                 group=32)


def _cases():
    torch.manual_seed(3)
    w = torch.randn(48, 256, device=DEVICE)
    return {"fp8 channel": quantize_fp8(w), "fp8 block": quantize_fp8(w, (16, 32)),
            "int4": quantize_int4(w, 32), "int4 asym": quantize_int4(w, 32, sym=False)}


@pytest.mark.parametrize("name", ["fp8 channel", "fp8 block", "int4", "int4 asym"])
def test_each_layer_replays_every_candidate_the_tuner_could_pick(name, monkeypatch):
    """A decode-row call takes the tuner's recorded choice; each candidate gives the layer's
    result (FP8 ones within the activation rounding the default path adds)."""
    p = _cases()[name]
    q = make_quant_linear(p, torch.device(DEVICE))
    x = torch.randn(1, 3, 256, device=DEVICE)  # [batch, tokens, features]: 3 rows
    default = q(x)
    want = x @ dequantize_packed(p).t()
    # FP8: the default path's FP8 activations; INT4 on a GPU: tl.dot's TF32 inputs
    rel = 2 ** -4 if name.startswith("fp8") else (2e-3 if DEVICE == "cuda" else 1e-5)
    _close(default, want, rel)
    monkeypatch.setattr(launch_tuner, "TUNED", {})
    picks = []
    real = launch_tuner.run_fastest

    def spy(key, names, run, device):
        picks.append((key, list(names)))
        return real(key, names, run, device)

    monkeypatch.setattr("shoal.layers.quantization.methods.run_fastest", spy)
    q(x)
    (key, names), = picks
    # 3 rows -> the 4-row bucket; on a GPU this tiny shape may leave the kernel alone (the
    # GPU's strips are wider than its block-scale groups take)
    assert key[0].startswith(name) and key[-2] == 4 and len(names) >= (3 if DEVICE == "cpu"
                                                                          else 1)
    if DEVICE == "cuda":  # the GPU timed them all and picked one
        assert set(launch_tuner.TUNED[key].times_us) == set(names)
    for cand in names[1:]:
        launch_tuner.TUNED[key] = launch_tuner.Tuned(cand)
        got = q(x)
        assert got.shape == (1, 3, 48)
        _close(got, want)  # the GEMVs are weight-only: exact up to float32 sums


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's behaviour")
def test_the_cpu_never_times_and_keeps_the_heuristics_pick(monkeypatch):
    monkeypatch.setattr(launch_tuner, "TUNED", {})
    ran = []
    launch_tuner.run_fastest(("k",), ("first", "second"),
                             lambda name: ran.append(name) or torch.zeros(1),
                             torch.device("cpu"))
    assert ran == ["first"] and launch_tuner.TUNED == {}


def test_a_shapes_candidates_are_built_once():
    """The eager decode path asks for a shape's candidates at every call: the second ask
    is the cached object, not a rebuilt list."""
    from shoal.layers.quantization import methods

    q = make_quant_linear(_cases()["int4"], torch.device(DEVICE))
    x = torch.randn(2, 256, device=DEVICE)
    q(x)
    before = methods._int4_candidates.cache_info()
    q(x)
    after = methods._int4_candidates.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1


def test_more_rows_than_the_gemv_holds_skip_the_tuner(monkeypatch):
    q = make_quant_linear(_cases()["int4"], torch.device(DEVICE))
    monkeypatch.setattr("shoal.layers.quantization.methods.run_fastest",
                        lambda *a: pytest.fail("tuned a prefill"))
    x = torch.randn(decode_gemv.MAX_ROWS + 1, 256, device=DEVICE)
    # the W4A16 GEMM's tl.dot takes TF32 inputs on a GPU
    _close(q(x), x @ dequantize_packed(_cases()["int4"]).t(), 2e-3 if DEVICE == "cuda" else 1e-5)


def test_a_fast_candidate_that_computes_garbage_is_never_picked(monkeypatch, caplog):
    """The tuner checks each candidate's output against its first (the heuristic's pick)
    before it may win on time: a race or a wrong mask in a fast launch shape is dropped."""
    speed = {"reference": 9.0, "fast but wrong": 1.0, "right": 5.0, "fast nan": 0.5}
    out = {"reference": torch.ones(4, 8), "fast but wrong": torch.zeros(4, 8),
           "right": torch.ones(4, 8) * 1.01, "fast nan": torch.full((4, 8), float("nan"))}
    # (the label is "<key> <candidate name>")
    monkeypatch.setattr(launch_tuner, "gpu_time_us",
                        lambda fn, label="": speed[label.removeprefix("('k',) ")])
    tuned = launch_tuner._time(("k",), {name: (lambda name=name: out[name]) for name in out})
    assert tuned.choice == "right"
    assert tuned.times_us["fast but wrong"] == tuned.times_us["fast nan"] == float("inf")
    assert "fast but wrong disagrees with the reference" in caplog.text


def test_one_row_per_channel_fp8_gets_the_long_steps(monkeypatch):
    """The GPU candidate list (the device's SM count faked): one row of a per-channel weight
    adds ONE_ROW_LONG_STEPS whose step fits K; more rows and block scales do not."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    gpu = torch.device("cuda")

    def long_steps(n, k, group, rows):
        return {(t.block_n, t.block_k) for t in decode_gemv.fp8_candidates(n, k, group, gpu, rows)
                if t.block_k >= 1024}

    assert long_steps(4096, 14336, 0, 1) == set(decode_gemv.ONE_ROW_LONG_STEPS)
    assert long_steps(4096, 1536, 0, 1) == {(4, 1024), (8, 1024)}
    assert long_steps(4096, 14336, 0, 2) == set()
    assert long_steps(4096, 14336, 128, 1) == set()
