"""Reading an adapter's tensors (shoal/lora/weights.py): B's scale folded in with the bits of
the float32 round trip, in one pass when B is already in the model dtype."""

from __future__ import annotations

import pytest
import torch

from shoal.lora.weights import scaled


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float16),
                                     (torch.float32, torch.float32),
                                     (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("scaling", [2.0, 0.5, 1 / 3, 0.7071067811865476, 1.0, 1.37])
def test_scaled_matches_the_float32_round_trip(src, dst, scaling):
    b = (torch.randn(4096, 16, generator=torch.Generator().manual_seed(3)) * 3).to(src)
    want = (b.float() * scaling).to(dst)
    got = scaled(b, scaling, dst)
    assert got.dtype == dst and torch.equal(got, want)
