"""The tensor-core INT4 decode GEMV (shoal/layers/quantization/int4_mma_gemv.py) against plain
PyTorch (codes dequantized in float64), in Triton's interpreter on the CPU (conftest.py):
bf16 and fp16 activations, every nibble position and zero point, rows that do not fill the
MMA's 8 columns, columns past N, a step of 8 and of 16 words, a K split summed by the strip's
last program (its counters back at zero); the candidates a GPU would time; bad launches. On a
GPU: every candidate at Llama-3.1-8B's projections against the same reference and its time
beside the wide kernel's best (printed with -s)."""

from __future__ import annotations

import pytest
import torch

from shoal.layers.ops import program_counters
from shoal.layers.quantization import int4_mma_gemv as mma
from shoal.layers.quantization.decode_gemv import GemvTiles, int4_gemv
from shoal.layers.quantization.methods import _gemv_name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(m: int, n: int, k: int, group: int, asym: bool, dtype: torch.dtype, seed: int):
    """Codes 0..15 packed 8 a word along K (GPTQ's layout, [K / 8, N]), scales in x's dtype,
    zero points 0..15 or none (8), x [m, K]; and x @ W^T in float64 from the same values."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 16, (k, n), generator=g)
    words = (codes.view(-1, 8, n) << (4 * torch.arange(8)).view(1, 8, 1)).sum(1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    scales = ((torch.rand(groups, n, generator=g) + 0.5) / 16).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=g).to(torch.uint8) if asym else None
    x = torch.randn(m, k, generator=g).to(dtype)
    gi = torch.arange(k) // group
    zero = 8 if zeros is None else zeros.long()[gi]
    weight = (codes - zero).double() * scales.double()[gi]
    want = x.double() @ weight
    dev = torch.device(DEVICE)
    return (x.to(dev), words.to(dev), scales.to(dev),
            None if zeros is None else zeros.to(dev), want.to(dev))


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one rounding of the output's dtype (the float32 sums' order aside)."""
    assert got.dtype == dtype and got.shape == want.shape
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (got.double() - want).abs()
    assert bool((err <= ulp * want.abs() + 1e-3 * want.abs().max()).all()), err.max().item()


@pytest.mark.parametrize("m,n,k,group,asym,dtype,block_n,words,split", [
    # one row, bf16, a partial strip (40 of 64 columns), two groups, no split
    (1, 40, 256, 128, False, torch.bfloat16, 64, 16, 1),
    # 3 rows of the 8 columns, fp16, zero points, a step of 8 words, 3 programs along K
    (3, 48, 512, 64, True, torch.float16, 16, 8, 3),
    # 8 rows, one group over all of K, split in two
    (8, 16, 128, 1 << 20, False, torch.bfloat16, 16, 8, 2),
    # bf16 with zero points and a split that leaves the last program fewer steps
    (2, 32, 640, 128, True, torch.bfloat16, 32, 16, 3),
    # 5 rows; split 4 asked over 5 steps: recomputed to 3 programs (2 + 2 + 1 steps)
    (5, 16, 640, 128, False, torch.float16, 16, 16, 4),
])
def test_mma_gemv_matches_the_dequantized_matmul(m, n, k, group, asym, dtype, block_n, words,
                                                  split):
    x, codes, scales, zeros, want = _problem(m, n, k, group, asym, dtype, seed=m + n)
    got = mma.int4_mma_gemv(x, codes, scales, zeros, group, block_n=block_n, words=words,
                            split=split, num_warps=4, num_stages=1)
    _check(got, want, dtype)
    if split > 1:  # the last program of each strip put its counter back
        assert not program_counters._COUNTERS[x.device][-1].any()
    # the same through int4_gemv, as the tuner names it
    tiles = GemvTiles(block_n, 8 * words, split, num_warps=4, num_stages=1, kernel="mma")
    assert torch.equal(int4_gemv(x, codes, scales, zeros, group, tiles), got)


@pytest.mark.parametrize("m,n,k,group,asym,block_n,words,split", [
    (1, 64, 512, 128, False, 32, 16, 2),  # two strips, a K split
    (3, 32, 256, 64, True, 16, 8, 1),  # zero points, a step of 8 words
])
def test_tiled_codes_give_the_same_bits(m, n, k, group, asym, block_n, words, split):
    """tile_codes' layout (each step's tile contiguous) read by the kernel's TILED branch: the
    same sums in the same order as GPTQ's layout, so the same bits."""
    x, codes, scales, zeros, want = _problem(m, n, k, group, asym, torch.bfloat16, seed=7)
    kw = dict(block_n=block_n, words=words, split=split, num_warps=4, num_stages=1)
    plain = mma.int4_mma_gemv(x, codes, scales, zeros, group, **kw)
    tiled = mma.tile_codes(codes, block_n, words)
    assert tiled.shape == (n // block_n, k // (8 * words), words, block_n)
    assert torch.equal(tiled[1, 0, 2], codes[2, block_n:2 * block_n])  # strip 1, step 0, word 2
    assert torch.equal(mma.int4_mma_gemv(x, tiled, scales, zeros, group, tiled=True, **kw),
                       plain)
    _check(plain, want, torch.bfloat16)
    with pytest.raises(ValueError, match="tiled codes"):
        mma.int4_mma_gemv(x, codes, scales, zeros, group, tiled=True, **kw)
    with pytest.raises(ValueError, match="tiles"):
        mma.tile_codes(codes[:, :block_n - 1], block_n, words)


def test_bad_mma_launches_are_refused_by_name():
    x, codes, scales, _, _ = _problem(1, 16, 128, 64, False, torch.bfloat16, seed=0)
    kw = dict(block_n=16, split=1, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mma.int4_mma_gemv(x.float(), codes, scales, None, 64, words=8, **kw)
    with pytest.raises(ValueError, match="dividing both"):
        mma.int4_mma_gemv(x, codes, scales, None, 64, words=16, **kw)  # 128 > the group
    with pytest.raises(ValueError, match="1..8 rows"):
        mma.int4_mma_gemv(x.expand(9, 128), codes, scales, None, 64, words=8, **kw)
    with pytest.raises(ValueError, match="block_n"):
        mma.int4_mma_gemv(x, codes, scales, None, 64, words=8, **{**kw, "block_n": 8})
    assert not mma.fits(torch.bfloat16, 200, 1 << 20, 8)  # K not a multiple of the step


@pytest.mark.parametrize("switch,takes_part", [("1", True), ("0", False)])
def test_the_launch_takes_pdl_as_shoal_int4_pdl_says(monkeypatch, switch, takes_part):
    """SHOAL_INT4_PDL on (the default): the kernel gets pdl.kwargs (the PDL constexpr and
    launch_pdl) where PDL is on for the device; off: a plain launch, whatever pdl says."""
    x, codes, scales, _, _ = _problem(1, 16, 128, 64, False, torch.bfloat16, seed=0)
    launched = {}

    class Kernel:  # records the launch instead of running it
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.update(kwargs)

    monkeypatch.setattr(mma, "_int4_mma_kernel", Kernel())
    monkeypatch.setattr(mma.pdl, "kwargs", lambda device: {"PDL": True, "launch_pdl": True})
    monkeypatch.setenv("SHOAL_INT4_PDL", switch)
    mma.int4_mma_gemv(x, codes, scales, None, 64, words=8, block_n=16, split=1, num_warps=4,
                      num_stages=1)
    assert ("PDL" in launched and "launch_pdl" in launched) == takes_part
    assert launched["num_warps"] == 4


@pytest.mark.parametrize("n,k,group,sms", [
    (6144, 4096, 128, 132), (4096, 4096, 128, 132), (28672, 4096, 128, 132),
    (4096, 14336, 128, 132), (256, 640, 128, 20), (11008, 11008, 64, 20), (64, 64, 1 << 20, 8),
])
def test_gpu_candidates_fit_the_kernel(n, k, group, sms):
    """The launches a GPU would time (Llama-3.1-8B's projections on 132 SMs, and odd shapes):
    unique names, every one taken by the kernel, splits of powers of two within half the
    steps (one step: no split)."""
    launches = mma.launches(n, k, group, sms)
    tiles = [GemvTiles(b, 8 * w, s, num_warps=nw, num_stages=1, kernel="mma")
             for b, w, s, nw in launches]
    names = [_gemv_name(t) for t in tiles]
    assert tiles and len(set(names)) == len(names)
    for block_n, words, split, _ in launches:
        assert mma.fits(torch.bfloat16, k, group, words) and block_n >= 16
        steps = k // (8 * words)
        assert split & (split - 1) == 0 and split <= max(1, steps // 2)


def test_no_launch_where_no_step_fits():
    assert mma.launches(4096, 4096, 32, sms=132) == []  # a group narrower than 8 words
    assert mma.launches(4096, 200, 1 << 20, sms=132) == []  # K not a multiple of 64
    assert {w for _, w, _, _ in mma.launches(4096, 4096, 64, sms=132)} == {8}


def test_the_tuner_offers_mma_only_for_half_activations(monkeypatch):
    """decode_gemv._mma: bf16 / fp16 activations on an NVIDIA GPU; float32 (the kernel's magic
    constant is the activations' type) and unknown dtypes get none."""
    from shoal.layers.quantization import decode_gemv

    dev = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: type("P", (), {"multi_processor_count": 132})())
    monkeypatch.setattr(torch.version, "hip", None)
    assert decode_gemv._mma(4096, 4096, 128, dev, torch.bfloat16)
    assert decode_gemv._mma(4096, 4096, 128, dev, torch.float16)
    assert decode_gemv._mma(4096, 4096, 128, dev, torch.float32) == []
    assert decode_gemv._mma(4096, 4096, 128, dev, None) == []
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert decode_gemv._mma(4096, 4096, 128, dev, torch.bfloat16) == []


# ---- the GPU: every candidate at real shapes, and its time -----------------------------------

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_gpu_candidates_agree_and_their_times(rows):
    """bf16, g128, symmetric: each mma tile within one rounding of the float64 reference, and
    each tile's time (launch_tuner.gpu_time_us) beside the wide kernel's best, in TB/s of the
    codes and scales read."""
    from shoal.layers.quantization import launch_tuner
    from shoal.layers.quantization.decode_gemv import int4_candidates

    dev = torch.device("cuda")
    total = {"mma": 0.0, "wide": 0.0}
    for name, (n, k) in LLAMA_8B.items():
        x, codes, scales, _, want = _problem(rows, n, k, 128, False, torch.bfloat16, seed=5)
        nbytes = codes.numel() * 4 + scales.numel() * 2
        times = {}
        for t in int4_candidates(n, k, 128, dev, 1 << (rows - 1).bit_length(),
                                 torch.bfloat16):
            if t.kernel not in ("mma", "wide"):
                continue
            label = _gemv_name(t)
            if t.kernel == "mma":
                _check(int4_gemv(x, codes, scales, None, 128, t), want, torch.bfloat16)
            times[label] = launch_tuner.gpu_time_us(
                lambda t=t, x=x, c=codes, s=scales: int4_gemv(x, c, s, None, 128, t), label)
        for kind in total:
            best = min((v, lbl) for lbl, v in times.items() if f" {kind} w" in lbl)
            total[kind] += best[0]
            print(f"\nrows {rows} {name} N={n} K={k}: best {kind} {best[1]} {best[0]:.2f} us "
                  f"({nbytes / best[0] / 1e6:.2f} TB/s)")
        for label, us in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {label:40s} {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s")
    print(f"\nrows {rows}: a layer's four projections, best of each kind: mma "
          f"{total['mma']:.1f} us, wide {total['wide']:.1f} us")
    assert all(v < float("inf") for v in total.values())
