"""The CPU kernels behind the greedy token and the finiteness check (shoal/csrc/
sampling_cpu.cpp) against torch: ties, infinities, NaN, float32 and bfloat16, odd widths."""

from __future__ import annotations

import pytest
import torch

from shoal import cpu_kernels
from shoal.layers.ops import cpu_layer_ops
from shoal.sample.row_reductions import argmax_rows, rows_finite


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    missing = cpu_kernels.missing_toolchain()
    if missing:
        pytest.skip(f"cannot build the C++ CPU kernels here: {missing}")
    cpu_kernels.build()
    cpu_kernels.layer_ops_enabled.cache_clear()
    assert cpu_layer_ops.usable(torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [49152, 1000, 7])
def test_match_torch(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=gen).to(dtype)
    x[1, width // 2] = float("inf")
    x[2, 0] = float("-inf")
    x[3] = float("-inf")  # all -inf: index 0, not finite
    x[4, 3 % width] = x[4, width - 1] = 50  # a tie: the first index wins
    x[5, width - 1] = 99  # the last column
    x[6, width // 3] = float("nan")
    got_ids, got_finite = argmax_rows(x), rows_finite(x)
    assert torch.equal(got_finite, torch.isfinite(x).all(dim=-1))
    rows = [i for i in range(12) if i != 6]  # torch's argmax picks a NaN; callers fail the row
    assert torch.equal(got_ids[rows], x.argmax(dim=-1)[rows])
    assert got_ids.dtype == torch.long and got_finite.dtype == torch.bool


def test_strided_rows_and_other_devices_dtypes_use_torch() -> None:
    x = torch.randn(4, 64)[:, ::2]  # columns not contiguous: the torch path
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    h = torch.randn(3, 10).half()
    assert torch.equal(rows_finite(h), torch.isfinite(h).all(dim=-1))
