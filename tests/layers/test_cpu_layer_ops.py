"""The C++ CPU layer ops (shoal/csrc/layer_ops_cpu.cpp) against the layers' torch paths:
RMSNorm (alone, fused with the residual add, per head on a strided qkv view), SiLU-and-mul,
the rotary embedding and the KV cache write. Builds the extension if the Makefile's set-up has
not; skips only where this machine has no toolchain to build it with."""

from __future__ import annotations

import pytest
import torch

from shoal import cpu_kernels, envs
from shoal.attention import torch_backend
from shoal.layers.activation import SiluAndMul
from shoal.layers.norm import RMSNorm
from shoal.layers.ops import cpu_layer_ops
from shoal.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    missing = cpu_kernels.missing_toolchain()
    if missing:
        pytest.skip(f"cannot build the C++ CPU kernels here: {missing}")
    cpu_kernels.build()  # a compile error fails the tests: the toolchain is there
    cpu_kernels.layer_ops_enabled.cache_clear()
    assert cpu_layer_ops.usable(torch.zeros(1))


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 to rounding; bfloat16 bit-equal but for rare one-ulp flips (a float sum or exp
    that differs in its last bit before the rounding to bfloat16)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=8e-3)
    assert (got != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_alone_and_with_the_residual(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5, params_dtype=dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x = (torch.randn(37, 96, generator=gen) * 3).to(dtype)
    res = torch.randn(37, 96, generator=gen).to(dtype)
    close(norm(x), norm.forward_native(x))
    ref_out, ref_res = norm.forward_native(x, res)
    x2, res2 = x.clone(), res.clone()
    out, new_res = norm(x2, res2)
    assert out.data_ptr() == x2.data_ptr() and new_res.data_ptr() == res2.data_ptr()  # in place
    assert torch.equal(new_res, ref_res)  # the rounded sum is exact
    close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_a_strided_qkv_view(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    q = qkv[:, : 9 * 64].view(5, 9, 64)  # token stride 960, head stride 64
    norm = RMSNorm(64, eps=1e-6, params_dtype=dtype)
    norm.weight.data = torch.rand(64, generator=gen).to(dtype) + 0.5
    got = norm(q)
    assert got.is_contiguous()
    close(got, norm.forward_native(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(23, 2 * 80, generator=gen) * 6).to(dtype)  # far into both tails
    x[0, 0], x[0, 1] = -200, 200
    act = SiluAndMul()
    close(act(x), act.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_in_place_matches_the_torch_path(dtype: torch.dtype, rot_dim: int) -> None:
    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(64, 512, 10000.0)
    rope.rot_dim = rot_dim  # partial rotary: the rest of each head stays as it is
    rope.cos_sin_cache = rope.cos_sin_cache[:, :32].repeat(1, 2)[:, :rot_dim].contiguous()
    qkv = torch.randn(11, (4 + 2 + 2) * 64, generator=gen).to(dtype)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(11, 4, 64), k.view(11, 2, 64)
    pos = torch.randint(0, 512, (11,), generator=gen)
    ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
    got_q, got_k = rope(pos, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    close(got_q, ref_q)
    close(got_k, ref_k)
    with pytest.raises(RuntimeError, match="outside the table"):
        rope(torch.tensor([512] * 11), q, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_skips_padding_and_checks_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(6, (3 + 2 + 2) * 8, generator=gen).to(dtype)
    _, k, v = qkv.split([24, 16, 16], dim=-1)
    k, v = k.view(6, 2, 8), v.view(6, 2, 8)
    slots = torch.tensor([7, 0, 3, -1, 12, 5])
    cache = torch.randn(2, 16, 2, 8, generator=gen).to(dtype)
    ref = cache.clone()
    keep = slots >= 0
    ref[0].index_copy_(0, slots[keep], k[keep])
    ref[1].index_copy_(0, slots[keep], v[keep])
    torch_backend.write_kv_cache(cache, k, v, slots)
    assert torch.equal(cache, ref)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch_backend.write_kv_cache(cache, k, v, torch.tensor([0, 1, 2, 3, 4, 16]))


def test_other_dtypes_and_the_off_switch_take_the_torch_path(monkeypatch) -> None:
    assert not cpu_layer_ops.usable(torch.zeros(2, dtype=torch.float16))
    monkeypatch.setenv(envs.SHOAL_CPU_LAYER_KERNELS.name, "0")
    cpu_kernels.layer_ops_enabled.cache_clear()
    try:
        assert not cpu_layer_ops.usable(torch.zeros(2))
        x, res = torch.randn(3, 16), torch.randn(3, 16)
        out, _ = RMSNorm(16)(x, res)
        assert out.data_ptr() != x.data_ptr()  # the torch path returns new tensors
    finally:
        monkeypatch.undo()
        cpu_kernels.layer_ops_enabled.cache_clear()
    assert cpu_layer_ops.usable(torch.zeros(2))
