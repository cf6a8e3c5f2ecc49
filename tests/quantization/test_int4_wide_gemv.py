"""The wide INT4 decode GEMV (shoal/layers/quantization/int4_wide_gemv.py) against plain
PyTorch (codes dequantized to float32, one float32 matmul), in Triton's interpreter on the
CPU (conftest.py): every nibble position and zero point (the float bit trick), rows that do
not fill their block, K ending inside a group and inside a step, a K split summed by the
strip's last program (its counters back at zero for the next launch), prefetch; then the
candidates a GPU would time (names unique, every split within the kernel's limits)."""

from __future__ import annotations

import pytest
import torch

from shoal.layers.ops import program_counters
from shoal.layers.quantization import int4_wide_gemv as wide
from shoal.layers.quantization.decode_gemv import GemvTiles, int4_gemv, wide_tiles
from shoal.layers.quantization.methods import _gemv_name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(n: int, k: int, group: int, asym: bool, seed: int):
    """Random codes 0..15 packed GPTQ-style, scales and zero points 0..15, and the float32
    weight [K, N] they stand for."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 16, (k, n), generator=g)
    words = torch.zeros(-(-k // 8) * 8, n, dtype=torch.int64)
    words[:k] = codes
    words = (words.view(-1, 8, n) << (4 * torch.arange(8)).view(1, 8, 1)).sum(1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    scales = (torch.rand(groups, n, generator=g) + 0.5).half()
    zeros = torch.randint(0, 16, (groups, n), generator=g).to(torch.uint8) if asym else None
    gi = torch.arange(k) // group
    zero = 8 if zeros is None else zeros.long()[gi]
    weight = (codes - zero).float() * scales.float()[gi]
    dev = torch.device(DEVICE)
    return (words.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev),
            weight.to(dev))


@pytest.mark.parametrize("m,n,k,group,asym,tiles", [
    # one row, a partial strip, two programs along K summed by the last
    (1, 40, 128, 32, False, dict(block_n=64, step_w=4, split=2, prefetch=False)),
    # 3 rows of a block of 4, zero points, K ends mid-group and mid-step (the last of 3
    # programs has half a step), prefetch
    (3, 16, 72, 32, True, dict(block_n=16, step_w=2, split=3, prefetch=True)),
    # 8 rows, one group over all of K, no split
    (8, 16, 64, 1 << 20, False, dict(block_n=16, step_w=8, split=1, prefetch=False)),
])
def test_wide_gemv_matches_the_dequantized_matmul(m, n, k, group, asym, tiles):
    codes, scales, zeros, weight = _packed(n, k, group, asym, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    got = wide.int4_wide_gemv(x, codes, scales, zeros, group, num_warps=1, num_stages=1,
                              **tiles)
    want = x @ weight
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err  # exact up to the order of the sums
    if tiles["split"] > 1:  # the last program of each strip put its counter back
        assert not program_counters._COUNTERS[x.device][-1].any()


def test_bfloat16_rows_through_int4_gemv():
    """What the engine runs: bfloat16 activations, the tiles the tuner names."""
    codes, scales, _, weight = _packed(64, 128, 64, False, seed=3)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    tiles = GemvTiles(64, 64, 2, num_warps=1, num_stages=1, kernel="wide", prefetch=True)
    got = int4_gemv(x.bfloat16(), codes, scales, None, 64, tiles)
    want = x.bfloat16().float() @ weight
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs().max().item()
    assert err <= 2 ** -8 * want.abs().max().item(), err  # one bfloat16 rounding


def test_bad_wide_launches_are_refused_by_name():
    codes, scales, _, _ = _packed(16, 64, 32, False, seed=0)
    x = torch.randn(1, 64, device=DEVICE)
    kw = dict(block_n=16, split=1, prefetch=False, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match="must divide the group"):
        wide.int4_wide_gemv(x, codes, scales, None, 32, step_w=8, **kw)
    with pytest.raises(ValueError, match="power of two"):
        wide.int4_wide_gemv(x, codes, scales, None, 32, step_w=3, **kw)
    with pytest.raises(ValueError, match="1..8 rows"):
        wide.int4_wide_gemv(x.expand(9, 64), codes, scales, None, 32, step_w=2, **kw)
    with pytest.raises(ValueError, match="is not 'strip', 'wide' or 'mma'"):
        int4_gemv(x, codes, scales, None, 32, GemvTiles(16, 32, 1, kernel="dense"))


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_gpu_candidates_fit_the_kernel(rows):
    """The wide tiles an H100 would time for Llama-3.1-8B's projections: unique names, a
    step inside one group of 128, splits of at least 2 within the kernel's limits."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        tiles = wide_tiles(n, k, 128, rows, sms=132)
        names = [_gemv_name(t) for t in tiles]
        assert tiles and len(set(names)) == len(names)
        assert all(name.startswith("gemv n") and " wide w1" in name for name in names)
        for t in tiles:
            assert t.kernel == "wide" and 128 % t.block_k == 0
            chunk = wide.partial_chunk(rows, t.block_n // 32)
            assert 2 <= t.split <= min(k // 128, 4 * chunk) and t.split & (t.split - 1) == 0
