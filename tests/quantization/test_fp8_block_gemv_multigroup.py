"""Block-scaled FP8 decode GEMV with a K step of several scale groups (decode_gemv.py,
_fp8_group_steps) against plain PyTorch: the FP8 weight dequantized with its block scales,
one float32 matmul. Triton's interpreter on the CPU (conftest.py), tiny shapes: 2 and 4
groups a step, 1 and 3 rows, K a multiple of the step or not (ending mid-group), split K,
N not a multiple of the strip, strips within one row block of scales or across several.
The scales are random per block (not amax-derived, hence alike) so that a scale read for
the wrong group or row block shows. The GPU test times the old (one group a step) and new
tiles at the Llama-3.1-8B shapes."""

from __future__ import annotations

import functools

import pytest
import torch

from shoal.layers.quantization import decode_gemv, launch_tuner
from shoal.layers.quantization.decode_gemv import GemvTiles, fp8_candidates, fp8_gemv
from shoal.layers.quantization.methods import FP8BlockLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _block_weight(n: int, k: int, rows: int, group: int, device: str = DEVICE, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 [N, K] and float32 scales [ceil(N / rows), ceil(K / group)] in [0.25, 1.75),
    a view into NaN: a scale read past the last group or row block poisons the output."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, device=device, generator=g) * 64).clamp(-448, 448)
    shape = (-(-n // rows), -(-k // group))
    padded = torch.full((shape[0] + 1, shape[1] + 3), float("nan"), device=device)
    padded[:shape[0], :shape[1]] = torch.rand(shape, device=device, generator=g) * 1.5 + 0.25
    return w.to(torch.float8_e4m3fn), padded[:shape[0], :shape[1]]


def _reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, rows: int, group: int
               ) -> torch.Tensor:
    n, k = w.shape
    assert not scale.isnan().any()
    full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(group, 1)[:, :k]
    return x.float() @ (w.float() * full).t()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


# (m, n, k, group, scale_rows, tiles): BLOCK_K of 2 and 4 groups; scale_rows a multiple of
# block_n (the strip shares one scale row: STRIP_SCALES), 1 (a scale row each) or smaller
# than block_n (a strip across two row blocks)
CASES = [
    (1, 40, 128, 16, 16, GemvTiles(16, 32, 1)),  # 2 groups, K a multiple, shared scale row
    (1, 44, 200, 16, 16, GemvTiles(8, 64, 2)),  # 4 groups, K ends mid-group, split
    (1, 40, 200, 16, 1, GemvTiles(16, 32, 2)),  # a scale row per weight row, split
    (1, 36, 128, 16, 8, GemvTiles(16, 64, 1)),  # strips across two row blocks
    (3, 40, 200, 16, 16, GemvTiles(16, 32, 1)),  # 3 rows, K ends mid-group
    (3, 44, 128, 16, 1, GemvTiles(8, 64, 2)),  # 3 rows, a scale row each, split
    (3, 36, 200, 16, 8, GemvTiles(16, 64, 2)),  # 3 rows across row blocks, split, partial K
    (3, 40, 128, 32, 16, GemvTiles(16, 64, 1)),  # 3 rows, 2 groups of 32, shared scale row
]


@pytest.mark.parametrize("m,n,k,group,scale_rows,tiles", CASES)
def test_multigroup_steps_match_dequantized_matmul(m, n, k, group, scale_rows, tiles):
    assert tiles.block_k > group and n % tiles.block_n  # the cases this file is about
    w, scale = _block_weight(n, k, scale_rows, group)
    x = torch.randn(m, k, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    got = fp8_gemv(x, w, scale, tiles, group=group, scale_rows=scale_rows)
    assert got.shape == (m, n) and got.dtype == x.dtype
    _close(got, _reference(x, w, scale, scale_rows, group), 1e-5)


def test_bfloat16_rows_with_split_partials_round_once():
    """bf16 activations (the engine's): float32 partials of each split, summed and rounded
    to bfloat16 once."""
    w, scale = _block_weight(40, 200, 16, 16, seed=2)
    x = torch.randn(1, 200, device=DEVICE).bfloat16()
    got = fp8_gemv(x, w, scale, GemvTiles(16, 64, 2), group=16, scale_rows=16)
    assert got.dtype == torch.bfloat16
    _close(got, _reference(x, w, scale, 16, 16), 2 ** -7)


def test_a_step_neither_within_nor_a_multiple_of_the_group_is_refused():
    w, scale = _block_weight(16, 96, 16, 48)
    with pytest.raises(ValueError, match="or be a multiple of it"):
        fp8_gemv(torch.randn(1, 96, device=DEVICE), w, scale, GemvTiles(16, 32, 1), group=48)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's candidate strips")
def test_block_candidates_keep_the_one_group_steps_then_add_multigroup_ones():
    cpu = torch.device("cpu")
    steps = lambda group: [t.block_k for t in fp8_candidates(40, 256, group, cpu)]  # noqa: E731
    assert steps(0) == [32, 16]  # per channel: unchanged
    assert steps(32) == [32, 16]  # every strip within a group, as before
    assert steps(16) == [16, 32]  # the one-group strip first, then the 2-group one
    assert steps(8) == [32, 16]  # 4 and 2 groups a step
    assert steps(4) == [16]  # 8 groups a step is past MAX_STEP_GROUPS
    assert decode_gemv.MAX_STEP_GROUPS == 4


def _spy_tuner(monkeypatch) -> list[tuple]:
    """(key, candidate names) of each run_fastest call of the quantized layers."""
    from shoal.layers.quantization import methods

    seen = []
    real = launch_tuner.run_fastest
    monkeypatch.setattr(methods, "run_fastest", lambda key, names, run, device: (
        seen.append((key, list(names))) or real(key, names, run, device)))
    return seen


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's candidate list")
def test_the_block_layer_replays_a_multigroup_candidate(monkeypatch):
    """FP8BlockLinear's decode rows through the tuner's recorded choice: the multi-group
    tile of the CPU's list runs and gives the dequantized matmul."""
    w, scale = _block_weight(40, 128, 16, 16, seed=3)
    layer = FP8BlockLinear(w, scale, 16, 16)
    x = torch.randn(2, 128)
    monkeypatch.setattr(launch_tuner, "TUNED", {})
    seen = _spy_tuner(monkeypatch)
    layer(x)  # the CPU times nothing: the heuristic's pick (the block GEMM)
    (key, names), = seen
    assert names == ["block gemm", "gemv n8 k16 split1", "gemv n16 k32 split2"]
    launch_tuner.TUNED[key] = launch_tuner.Tuned("gemv n16 k32 split2")
    calls = []
    real = decode_gemv.fp8_gemv
    monkeypatch.setattr(decode_gemv, "fp8_gemv",
                        lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    _close(layer(x), _reference(x, w, scale, 16, 16), 1e-5)
    assert calls == [GemvTiles(16, 32, 2)]


# Llama-3.1-8B's linear layers at batch 1 (N, K): qkv, o, gate_up, down
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}
EXTRA_STRIPS = ((16, 512), (32, 256), (8, 256))  # timed beside the candidates, for the record


def _timed(tiles: list[GemvTiles], want: torch.Tensor, *args, **kw
           ) -> list[tuple[float, GemvTiles]]:
    """(microseconds, tiles) of fp8_gemv(*args, tiles, **kw) for each tile, fastest first,
    each checked against want (bf16 output rounding) before it is timed."""
    out = []
    for t in tiles:
        fn = functools.partial(fp8_gemv, *args, t, **kw)
        _close(fn(), want, 2 ** -7)
        out.append((launch_tuner.gpu_time_us(fn, str(t)), t))
    return sorted(out, key=lambda p: p[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on the GPU")
def test_time_one_and_multigroup_tiles_at_llama_8b_shapes(monkeypatch):
    """Each block-scale candidate (128x128 blocks, bf16 rows) checked against the dequantized
    matmul and timed as the tuner times it (a CUDA graph of calls), beside the per-channel
    candidates on the same bytes; prints the best of each kind per shape, a 32-layer token's
    sum, and what the tuner picks through FP8BlockLinear."""
    dev = torch.device("cuda")
    totals = {"old block": 0.0, "multigroup": 0.0, "per channel": 0.0}
    monkeypatch.setattr(launch_tuner, "TUNED", {})
    monkeypatch.setenv("SHOAL_QUANT_TUNING", "1")
    seen = _spy_tuner(monkeypatch)
    for name, (n, k) in LLAMA_8B.items():
        w, scale = _block_weight(n, k, 128, 128, device="cuda", seed=4)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        want = _reference(x, w, scale, 128, 128)
        cands = fp8_candidates(n, k, 128, dev)
        new = [t for t in cands if t.block_k > 128]
        extra = [GemvTiles(bn, bk, s) for bn, bk in EXTRA_STRIPS for s in (1, 2)
                 if GemvTiles(bn, bk, s) not in new]
        block = {"group": 128, "scale_rows": 128}
        times = {"old block": _timed([t for t in cands if t.block_k <= 128], want, x, w, scale,
                                     **block),
                 "multigroup": _timed(new, want, x, w, scale, **block),
                 "extra": _timed(extra, want, x, w, scale, **block)}
        assert times["old block"] and times["multigroup"], (name, cands)
        row_scale = scale.repeat_interleave(128, 0)[:n, 0].contiguous()
        times["per channel"] = _timed(fp8_candidates(n, k, 0, dev),
                                      x.float() @ (w.float() * row_scale[:, None]).t(),
                                      x, w, row_scale)
        _close(FP8BlockLinear(w, scale, 128, 128)(x), want, 2 ** -4)  # (the GEMM rounds x)
        picked = launch_tuner.TUNED[seen[-1][0]]
        print(f"\n{name} N={n} K={k}: tuner picked {picked.choice!r} "
              f"({picked.times_us[picked.choice]:.1f} us)")
        for kind, timed in times.items():
            totals[kind] = totals.get(kind, 0.0) + timed[0][0]
            print(f"  {kind:12s} best {timed[0][0]:7.1f} us  | "
                  + ", ".join(f"n{t.block_n} k{t.block_k} split{t.split} {us:.1f}"
                              for us, t in timed))
    totals.pop("extra")
    print("\n32 layers, one token (best tile per shape): "
          + ", ".join(f"{kind} {32 * us / 1e3:.3f} ms" for kind, us in totals.items()))
    assert all(us < float("inf") for us in totals.values())
