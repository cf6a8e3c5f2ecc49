"""The attention-kernel warmup runs every variant a step can pick, and a forced query-tile
height gives the same result as the one paged_prefill picks itself (conftest.py: the Triton
interpreter on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.ops.paged_decode import MAX_SPLITS  # noqa: E402
from shoal.attention.ops.paged_prefill import paged_prefill, prefill_tile_heights  # noqa: E402
from shoal.attention.ops.warm import warm_paged_attention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_tile_heights_cover_what_prefill_picks():
    assert prefill_tile_heights(1, 128, torch.bfloat16) == [16, 32, 64, 128]
    assert prefill_tile_heights(4, 64, torch.float32) == [16, 32, 64]
    assert prefill_tile_heights(32, 256, torch.bfloat16) == [32, 64]


def test_warmup_runs_every_split_and_tile_height():
    hk, hq, d, bs = 2, 4, 32, 16
    cache = torch.randn(2, 4 * bs, hk, d, device=DEV)
    runs = warm_paged_attention(cache, hq, 1 / math.sqrt(d), bs, None)
    splits = int(math.log2(MAX_SPLITS)) + 1
    assert runs == splits + len(prefill_tile_heights(hq // hk, d, torch.float32))


def test_forced_tile_height_and_first_row_match_the_default():
    gen = torch.Generator().manual_seed(0)
    hk, hq, d, bs = 2, 4, 32, 16
    cache = torch.randn(2, 8 * bs, hk, d, generator=gen).to(DEV)
    # Row 0 is someone else's (a decode); rows 1 and 2 are prefill chunks after a context.
    tables = torch.tensor([[7, 0, 0], [1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([5, 40, 20], dtype=torch.int32, device=DEV)
    starts = torch.tensor([0, 1, 11, 31], dtype=torch.int32, device=DEV)  # 10 and 20 tokens
    q = torch.randn(31, hq, d, generator=gen).to(DEV)
    scale = 1 / math.sqrt(d)
    sliced = paged_prefill(q, cache, tables[1:], lens[1:], starts[1:], 20, bs, scale)
    whole = paged_prefill(q, cache, tables, lens, starts, 20, bs, scale, first_row=1)
    torch.testing.assert_close(whole[1:], sliced[1:])
    for block_m in prefill_tile_heights(hq // hk, d, q.dtype):
        forced = paged_prefill(q, cache, tables, lens, starts, 20, bs, scale, first_row=1,
                               block_m=block_m)
        torch.testing.assert_close(forced[1:], sliced[1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_m"):
        paged_prefill(q, cache, tables, lens, starts, 20, bs, scale, block_m=48)
