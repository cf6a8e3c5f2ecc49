"""The C++ small-step linear (shoal/csrc/small_linear_cpu.cpp) against F.linear: float32 to
rounding, bfloat16 within its own rounding, with and without bias, every row count it takes,
odd K (the scalar tail), a strided x; larger steps go to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal import cpu_kernels
from shoal.layers.ops import small_linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"C++ CPU kernels not built: "
                                       f"{cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k", [576, 67])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_equals_f_linear(rows: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(300, k, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    out = torch.empty(rows, 300)
    torch.ops.shoal_cpu.small_linear(out, x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_bfloat16_within_its_rounding() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 576, generator=g).bfloat16()
    w = (torch.randn(1536, 576, generator=g) / 24).bfloat16()
    b = torch.randn(1536, generator=g).bfloat16()
    got = small_linear.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, atol=2e-2, rtol=1e-2)  # one bf16 rounding


def test_strided_x_and_the_fallback() -> None:
    x = torch.randn(4, 1000)[:, :576]  # rows not contiguous
    w = torch.randn(200, 576)
    torch.testing.assert_close(small_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    big = torch.randn(small_linear.MAX_ROWS + 1, 576)
    torch.testing.assert_close(small_linear.linear(big, w), F.linear(big, w))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="1 <= M <= 8"):
        torch.ops.shoal_cpu.small_linear(torch.empty(9, 4), torch.randn(9, 8), torch.randn(4, 8),
                                          None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.shoal_cpu.small_linear(torch.empty(1, 4), torch.randn(1, 8),
                                          torch.randn(4, 8).bfloat16(), None)
