"""The dense half-precision decode GEMV (shoal/layers/ops/half_gemv.py) against x.float() @
w.float().T (+ b), in Triton's interpreter on the CPU (conftest.py): 1, 2, 5 and 8 rows, N and
K not multiples of the tiles, bf16 and fp16, with and without bias, strided activation rows,
every tile the CPU candidate list holds plus GPU-sized ones (split, prefetch). Then the
dispatch of shoal/layers/ops/dense_linear.py: CUDA tensors (the device test patched) go
through the launch tuner with F.linear first and one key per shape, bias, row bucket and
dtype; CPU tensors, fp32, more rows and use_triton_ops=False keep the old path; the linear
layers (column, fused QKV / gate_up, row, replicated) call it. The GPU tests check the layers
on CUDA and time F.linear against each tile at GPT-OSS-20B's and Llama-3.1-8B's shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.layers import linear as linear_mod
from shoal.layers.ops import dense_linear, half_gemv
from shoal.layers.ops.half_gemv import HalfGemvTile
from shoal.layers.quantization import launch_tuner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # one rounding of the output

# every CPU candidate (split in two, prefetch), three K ranges, a GPU tile (256 x warps)
TILES = [*half_gemv.candidates(37, 203, 1, torch.device("cpu")), HalfGemvTile(8, 32, 3),
         HalfGemvTile(4, 1024, 1, prefetch=True)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=1e-3)


def _problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, strided: bool,
             seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + (5 if strided else 0), generator=g).to(DEVICE, dtype)[:, :k]
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g) if bias else None
    b = b.to(DEVICE, dtype) if bias else None
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    return x, w, b, want


@pytest.mark.parametrize("m,dtype,bias,strided", [
    (1, torch.bfloat16, True, False),
    (2, torch.float16, False, True),
    (5, torch.bfloat16, False, True),  # rows past M re-read the last one: never stored
    (8, torch.float16, True, False),
])
def test_every_tile_matches_float32_matmul(m, dtype, bias, strided):
    x, w, b, want = _problem(m, 37, 203, dtype, bias, strided, seed=m)
    assert strided == (x.stride(0) != x.shape[1])
    for tile in TILES:
        _close(half_gemv.half_gemv(x, w, b, tile), want, dtype)


def test_k_shorter_than_a_step_and_one_output_row():
    x, w, b, want = _problem(3, 1, 40, torch.bfloat16, True, False, seed=9)
    for tile in TILES:
        _close(half_gemv.half_gemv(x, w, b, tile), want, torch.bfloat16)


def test_bad_launches_are_refused_by_name():
    x, w = torch.randn(9, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    tile = HalfGemvTile(4, 64, 1)
    with pytest.raises(ValueError, match="1..8"):
        half_gemv.half_gemv(x, w, None, tile)
    with pytest.raises(ValueError, match="one of"):
        half_gemv.half_gemv(x[:2].float(), w.float(), None, tile)
    with pytest.raises(ValueError, match="bias"):
        half_gemv.half_gemv(x[:2], w, torch.zeros(5).bfloat16(), tile)
    with pytest.raises(ValueError, match="multiple of 8"):
        half_gemv.half_gemv(x[:2], w, None, HalfGemvTile(4, 12, 1))
    with pytest.raises(ValueError, match="rows 9"):
        half_gemv.candidates(4, 16, 9, torch.device("cpu"))


def test_split_only_where_the_strips_are_too_few():
    # 132 multiprocessors, block_k 1024: Llama's gate_up has strips to spare, GPT-OSS's o
    # (N 2880, 4 steps) splits in two at 8-row strips and not at 4
    assert half_gemv.split_for(28672, 4096, 4, 1024, 132) == 1
    assert half_gemv.split_for(2880, 4096, 8, 1024, 132) == 2
    assert half_gemv.split_for(2880, 4096, 4, 1024, 132) == 1
    assert half_gemv.split_for(512, 2880, 4, 1024, 132) == 1  # 3 steps: too short to cut
    assert half_gemv.split_for(256, 14336, 4, 1024, 132) == 4  # a split keeps 2 steps


# ---- the dispatch (dense_linear.py) and the layers -------------------------------------------


@pytest.fixture
def tuner(monkeypatch):
    """CPU tensors take the CUDA route (Triton's interpreter runs the GEMVs); the tuner's
    table starts empty and every run_fastest call is recorded as (key, names)."""
    monkeypatch.setattr(dense_linear, "_on_gpu", lambda x, enabled: enabled)
    monkeypatch.setenv("SHOAL_DENSE_GEMV", "1")
    monkeypatch.setattr(launch_tuner, "TUNED", {})
    calls = []
    real = launch_tuner.run_fastest

    def spy(key, names, run, device, agree=launch_tuner.AGREE):
        assert agree == launch_tuner.EXACT_OPERANDS_AGREE  # (exact operands: a tight check)
        calls.append((key, tuple(names)))
        return real(key, names, run, device, agree)

    monkeypatch.setattr(dense_linear, "run_fastest", spy)
    return calls


def test_decode_rows_go_through_the_tuner_with_f_linear_first(tuner):
    x, w, b, want = _problem(3, 37, 203, torch.bfloat16, True, False)
    got = dense_linear.linear(x.view(1, 3, 203), w, b)
    (key, names), = tuner
    assert key == ("dense half gemv", 37, 203, True, 4, torch.bfloat16)
    assert names[0] == dense_linear.REFERENCE and len(names) == 1 + len(
        half_gemv.candidates(37, 203, 4, x.device))
    assert got.shape == (1, 3, 37)
    if DEVICE == "cpu":  # not timed (nor during a capture): F.linear's exact result
        assert torch.equal(got.view(3, 37), F.linear(x, w, b))
        assert key not in launch_tuner.TUNED
    else:  # every candidate timed (inf: failed or disagreed)
        assert set(launch_tuner.TUNED[key].times_us) == set(names)
    for name in names[1:]:  # a timed choice is replayed
        launch_tuner.TUNED[key] = launch_tuner.Tuned(name)
        _close(dense_linear.linear(x, w, b), want, torch.bfloat16)


def test_one_key_per_shape_bias_row_bucket_and_dtype(tuner):
    w = torch.randn(16, 64)
    for rows, dtype, n, bias in [(3, torch.bfloat16, 16, False), (4, torch.bfloat16, 16, False),
                                 (5, torch.bfloat16, 16, False), (1, torch.float16, 16, False),
                                 (1, torch.bfloat16, 8, False), (1, torch.bfloat16, 8, True)]:
        b = torch.zeros(n, dtype=dtype) if bias else None
        dense_linear.linear(torch.randn(rows, 64, dtype=dtype), w[:n].to(dtype), b)
    keys = [key for key, _ in tuner]
    assert keys[0] == keys[1]  # 3 and 4 rows share the 4-row bucket
    assert len(set(keys)) == 5 and {k[4] for k in keys} == {1, 4, 8}
    assert {k[5] for k in keys} == {torch.bfloat16, torch.float16}


def test_the_old_path_where_the_gemv_does_not_apply(tuner):
    assert dense_linear.MAX_ROWS == half_gemv.MAX_ROWS
    w = torch.randn(16, 64).bfloat16()
    strided_k = torch.randn(64, 2).bfloat16().t()  # inputs 2 apart
    for x, wt, enabled in [(torch.randn(9, 64).bfloat16(), w, True),  # a prefill
                           (torch.randn(2, 64), w.float(), True),  # float32
                           (torch.randn(2, 64).bfloat16(), w, False),  # use_triton_ops off
                           (strided_k, w, True)]:
        got = dense_linear.linear(x, wt, None, enabled)
        assert torch.equal(got, dense_linear.small_linear.linear(x, wt))
    assert tuner == []


def test_switched_off(tuner, monkeypatch):
    """With SHOAL_DENSE_GEMV=0 decode rows keep F.linear's path."""
    monkeypatch.setenv("SHOAL_DENSE_GEMV", "0")
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    assert torch.equal(dense_linear.linear(x, w), dense_linear.small_linear.linear(x, w))
    assert tuner == []


def test_cpu_tensors_keep_small_linear(monkeypatch):
    """Without the patched device test a CPU tensor never reaches the tuner and gets what
    small_linear (the C++ kernel for a few rows) gives."""
    monkeypatch.setattr(dense_linear, "run_fastest", lambda *a: pytest.fail("tuned on CPU"))
    seen = []
    real = dense_linear.small_linear.linear
    monkeypatch.setattr(dense_linear.small_linear, "linear",
                        lambda *a: seen.append(a) or real(*a))
    x, w, b = torch.randn(2, 64).bfloat16(), torch.randn(16, 64).bfloat16(), None
    assert torch.equal(dense_linear.linear(x, w, b), real(x, w, b)) and len(seen) == 1


def _layers(dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    torch.manual_seed(5)
    layers = {
        "column bias": linear_mod.ColumnParallelLinear(40, 24, bias=True, params_dtype=dtype),
        "qkv bias": linear_mod.QKVParallelLinear(40, 8, 4, 2, bias=True, params_dtype=dtype),
        "gate_up": linear_mod.MergedColumnParallelLinear(40, [12, 12], params_dtype=dtype),
        "row bias": linear_mod.RowParallelLinear(40, 24, bias=True, params_dtype=dtype),
        "row": linear_mod.RowParallelLinear(40, 24, params_dtype=dtype),
        "replicated": linear_mod.ReplicatedLinear(40, 24, bias=True, params_dtype=dtype),
    }
    for layer in layers.values():
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape))
    return {name: layer.to(DEVICE) for name, layer in layers.items()}


def test_the_linear_layers_call_the_dispatch(tuner):
    layers = _layers(torch.bfloat16)
    x = torch.randn(2, 40, device=DEVICE, dtype=torch.bfloat16)
    for name, layer in layers.items():
        tuner.clear()
        want = x.float() @ layer.weight.float().T + (
            layer.bias.float() if layer.bias is not None else 0)
        # F.linear (untimed: the first candidate); the CPU's bf16 matmul is not correctly
        # rounded, the GEMVs below are
        got = layer(x).float()
        assert float((got - want).norm() / want.norm()) < 2 ** -7, name
        (key, names), = tuner
        n = layer.weight.shape[0]
        # (on the CPU the row layer adds its bias after the matmul; on CUDA inside it)
        assert key[1:3] == (n, 40) and names[0] == dense_linear.REFERENCE, name
        for cand in names[1:] if name in ("qkv bias", "row bias") else ():
            launch_tuner.TUNED[key] = launch_tuner.Tuned(cand)
            if name == "row bias" and DEVICE == "cpu":  # rounded, then the bias added
                torch.testing.assert_close(layer(x).float(), want, rtol=2 ** -6,
                                           atol=2 ** -7 * float(want.abs().max()))
            else:
                _close(layer(x), want, torch.bfloat16)
        layer.triton_gemv = False
        tuner.clear()
        layer(x)
        assert tuner == [], name


# ---- on a GPU ---------------------------------------------------------------------------------

SHAPES = {  # name: (N, K, bias)
    "gpt-oss-20b qkv": (5120, 2880, True),
    "gpt-oss-20b o": (2880, 4096, True),
    "llama-8b qkv": (6144, 4096, False),
    "llama-8b o": (4096, 4096, False),
    "llama-8b gate_up": (28672, 4096, False),
    "llama-8b down": (4096, 14336, False),
}
LAYERS = {"gpt-oss-20b": 24, "llama-8b": 32}
L2_FLUSH_BYTES = 256 << 20  # weight copies a timing cycles through: past any L2 (50-60 MB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA layers")
def test_layers_on_cuda_match_f_linear_for_every_candidate(monkeypatch):
    """Each layer kind on CUDA at 1, 3 and 8 rows: the first call times the candidates and
    records a pick; then each candidate replayed gives the float32 matmul's result rounded
    once (F.linear within cuBLAS's own rounding), the same bits call after call."""
    monkeypatch.setattr(launch_tuner, "TUNED", {})
    monkeypatch.setenv("SHOAL_QUANT_TUNING", "1")
    monkeypatch.setenv("SHOAL_DENSE_GEMV", "1")
    for name, layer in _layers(torch.bfloat16).items():
        for rows in (1, 3, 8):
            x = torch.randn(rows, 40, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ layer.weight.float().T + (
                layer.bias.float() if layer.bias is not None else 0)
            layer(x)  # timed here
            # (one rank on CUDA: the row layer's bias is the GEMV's too)
            key = dense_linear.tune_key(layer.weight.shape[0], 40, layer.bias is not None,
                                        rows, torch.bfloat16)
            assert key in launch_tuner.TUNED, (name, key)
            names = dense_linear._candidates(key[1], 40, key[4], x.device).names
            assert names[0] == dense_linear.REFERENCE and len(names) > 1
            for cand in names:
                launch_tuner.TUNED[key] = launch_tuner.Tuned(cand)
                got = layer(x)
                if cand == dense_linear.REFERENCE:
                    assert float((got.float() - want).norm() / want.norm()) < 2 ** -7
                else:
                    _close(got, want, torch.bfloat16)
                assert torch.equal(got, layer(x)), (name, rows, cand)  # same bits


def _time_us(fn, ws: list[torch.Tensor]) -> float:
    """The tuner's graph timing, each of its calls on the next weight copy (a weight read
    from memory, not from L2)."""
    at = [0]

    def call():
        at[0] = (at[0] + 1) % len(ws)
        return fn(ws[at[0]])
    return launch_tuner.gpu_time_us(call)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on the GPU")
def test_time_f_linear_and_each_tile_at_gpt_oss_and_llama_shapes():
    """Each tile checked against F.linear and timed as the tuner times (a CUDA graph of 10
    calls), every call on another copy of the weight so that the read comes from memory;
    prints microseconds and the fraction of the weight read's time at the card's copy
    bandwidth (benchmarks/offline_runs.COPY_BANDWIDTH_BY_GPU), and the best per shape."""
    name_gpu = torch.cuda.get_device_name()
    bandwidth = 3.0e12 if "H100" in name_gpu else 4.25e12 if "H200" in name_gpu else None
    dev = torch.device("cuda")
    print(f"\n{name_gpu}: copy bandwidth {bandwidth}")
    totals: dict[tuple[str, int], list[float]] = {}  # (model, rows): F.linear, best, floor
    for label, (n, k, has_bias) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-L2_FLUSH_BYTES // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
        floor_us = nbytes / bandwidth * 1e6 if bandwidth else float("nan")
        for rows in (1, 8):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            want = F.linear(x, ws[0], b).float()
            times = {"F.linear": _time_us(lambda w, x=x, b=b: F.linear(x, w, b), ws)}
            for tile in half_gemv.candidates(n, k, rows, dev):
                got = half_gemv.half_gemv(x, ws[0], b, tile).float()
                err = float((got - want).norm() / want.norm())
                assert err < 1e-2, (label, rows, tile, err)
                times[tile.name] = _time_us(
                    lambda w, x=x, b=b, tile=tile: half_gemv.half_gemv(x, w, b, tile), ws)
            for name, t in times.items():
                print(f"{label} N={n} K={k} T={rows} {name}: {t:.1f} us "
                      f"({floor_us / t:.2f} of the {floor_us:.1f} us read)")
            best = min(times, key=times.__getitem__)
            print(f"  best {best}: {times[best]:.1f} us, F.linear {times['F.linear']:.1f} us")
            step = totals.setdefault((label.split()[0], rows), [0.0, 0.0, 0.0])
            layers = LAYERS[label.split()[0]]
            step[0] += layers * times["F.linear"]
            step[1] += layers * times[best]
            step[2] += layers * floor_us
        del ws
        torch.cuda.empty_cache()
    for (model, rows), (cublas, best, floor) in totals.items():
        print(f"{model} T={rows}, these projections over {LAYERS[model]} layers: F.linear "
              f"{cublas:.0f} us, the best of each {best:.0f} us, the weight read {floor:.0f} us")


def test_an_engine_without_triton_ops_turns_the_layers_off(tmp_path):
    """LLM(use_triton_ops=False): every dense layer of the built model keeps F.linear's path
    (the layers' switch is class-wide on; the loader turns it off per module)."""
    from oracle import write_tiny_checkpoint

    from shoal import LLM

    path = write_tiny_checkpoint(tmp_path / "m", "llama")
    for flag in (True, False):
        llm = LLM(model=str(path), device="cpu", use_triton_ops=flag, max_model_len=64)
        try:
            model = llm.llm_engine.core.runner.model
            layers = [m for m in model.modules() if isinstance(m, linear_mod.DENSE_LAYERS)]
            assert layers and all(m.triton_gemv == flag for m in layers)
        finally:
            llm.shutdown()


def test_layers_built_inside_take_the_switch_given():
    """triton_ops_while_building (the loader's and the drafter factory's): layers built inside
    take its flag, layers built after it the default again."""
    with linear_mod.triton_ops_while_building(False):
        off = [linear_mod.ReplicatedLinear(4, 4), linear_mod.RowParallelLinear(4, 4),
               linear_mod.ColumnParallelLinear(4, 4)]
    assert not any(m.triton_gemv for m in off)
    assert linear_mod.ReplicatedLinear(4, 4).triton_gemv


def test_replicated_layers_keep_f_linear_over_several_ranks(monkeypatch):
    """A replicated layer's output must be the same bits on every tensor-parallel rank (a
    sparse indexer takes a top-k of it) and each rank's tuner may pick another tile: over
    two ranks it keeps F.linear; sharded layers, whose ranks compute different slices, may
    still take the GEMVs."""
    monkeypatch.setattr(linear_mod, "get_tp_world_size", lambda: 2)
    assert not linear_mod.ReplicatedLinear(4, 4).triton_gemv
    assert linear_mod.ColumnParallelLinear(4, 4).triton_gemv
    assert linear_mod.RowParallelLinear(4, 4).triton_gemv
