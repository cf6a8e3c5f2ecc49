"""4-bit GGUF weights through torch's int4 CPU kernel: the groups of a Q4_1 / Q4_0 weight are
recovered exactly from its dequantized values, the product matches the dense one within
bfloat16 rounding, weights that were never 4-bit stay dense, and the flag is refused where it
cannot apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.engine_args import EngineArgs
from shoal.layers import int4_cpu
from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.loader.build import convert_to_int4

pytestmark = pytest.mark.skipif(not int4_cpu.supported(), reason="no int4 CPU kernel")


def q4_weight(n: int, k: int, q4_0: bool = False, seed: int = 0):
    """A dequantized 4-bit weight as llama.cpp writes it: per group of 32, w = q * d + m with
    float16 d and m (Q4_0: m = -8 d), every group using q = 0 and q = 15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = -8 * d if q4_0 else (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return (q * d[..., None] + m[..., None]).view(n, k), q.view(n, k)


@pytest.mark.parametrize("q4_0", [False, True])
def test_groups_recovered_and_product_matches(q4_0):
    w, q = q4_weight(64, 128, q4_0)
    rec = int4_cpu.recover_groups(w)
    assert rec is not None and torch.equal(rec[0], q.int())
    packed = int4_cpu.pack_int4(w)
    x = torch.randn(5, 3, 128)
    y = int4_cpu.int4_linear(x, packed)
    ref = F.linear(x, w)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()


def test_bfloat16_model_weights_are_recovered_too():
    w, q = q4_weight(64, 128, seed=3)
    wb = w.bfloat16()
    rec = int4_cpu.recover_groups(wb)
    assert rec is not None and torch.equal(rec[0], q.int())
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y = int4_cpu.int4_linear(x, int4_cpu.pack_int4(wb))
    ref = F.linear(x.float(), w)
    assert y.dtype == torch.bfloat16 and (y.float() - ref).abs().max() < 0.03 * ref.abs().max()
    assert int4_cpu.pack_int4(torch.randn(64, 128).bfloat16()) is None


def test_weights_that_were_never_4bit_stay_dense():
    assert int4_cpu.pack_int4(torch.randn(64, 128)) is None  # float weights
    q8 = torch.randint(-127, 128, (64, 128)).float() * 0.01  # 8-bit levels
    assert int4_cpu.pack_int4(q8) is None
    assert int4_cpu.pack_int4(q4_weight(64, 100 + 28)[0][:, :100]) is None  # K % 32 != 0


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(128, 64)
        self.down = RowParallelLinear(64, 128)
        self.dense = ColumnParallelLinear(128, 32)

    def forward(self, x):
        return self.dense(self.down(self.up(x)))


def test_convert_linears_swaps_only_4bit_layers():
    m = _Tiny()
    with torch.no_grad():
        m.up.weight.copy_(q4_weight(64, 128, seed=1)[0])
        m.down.weight.copy_(q4_weight(128, 64, seed=2)[0])
        m.dense.weight.copy_(torch.randn(32, 128) * 0.05)
    x = torch.randn(4, 128)
    ref = m(x)
    stats = int4_cpu.convert_linears(m)
    assert (stats["converted"], stats["dense"]) == (2, 1)
    assert stats["int4_bytes"] * 6 < stats["dense_bytes"]
    assert m.up.int4 is not None and m.up.weight.numel() == 0 and m.dense.int4 is None
    assert (m(x) - ref).abs().max() < 0.03 * ref.abs().max()


def test_flag_refused_without_4bit_weights_or_off_the_cpu():
    m = _Tiny()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    with pytest.raises(ValueError, match="no 4-bit"):
        convert_to_int4(m, "x.safetensors", "all")
    convert_to_int4(m, "x.safetensors", "small_steps")  # the default: nothing to pack is fine
    assert m.up.int4 is None

    class Cfg:
        vocab_size, max_position_embeddings = 100, 256

    with pytest.raises(ValueError, match="cpu_int4_matmul"):
        EngineArgs(device="cuda", cpu_int4_matmul=True).create_engine_config(Cfg())


def test_small_steps_only_keeps_dense_weights_for_larger_steps():
    m = _Tiny()
    with torch.no_grad():
        m.up.weight.copy_(q4_weight(64, 128, seed=1)[0])
        m.down.weight.copy_(q4_weight(128, 64, seed=2)[0])
        m.dense.weight.copy_(torch.randn(32, 128) * 0.05)
    small, big = torch.randn(int4_cpu.SMALL_STEP_ROWS, 128), torch.randn(9, 128)
    ref_small, ref_big = m(small), m(big)
    stats = int4_cpu.convert_linears(m, small_steps_only=True)
    assert stats["converted"] == 2 and m.up.weight.numel() == 64 * 128  # dense kept
    assert m.up.int4.max_rows == int4_cpu.SMALL_STEP_ROWS
    assert torch.equal(m(big), ref_big)  # more rows: the dense weights, bit for bit
    got = m(small)
    assert not torch.equal(got, ref_small)  # the packed kernel (bfloat16 activations)
    assert (got - ref_small).abs().max() < 0.03 * ref_small.abs().max()


@pytest.mark.parametrize(("device", "dtype", "flag", "mode"), [
    ("cpu", "bfloat16", None, "small_steps"), ("cpu", "float32", None, "off"),
    ("cpu", "float32", True, "all"), ("cpu", "bfloat16", False, "off"),
    ("cuda", "bfloat16", None, "off")])
def test_the_default_packs_small_steps_of_bfloat16_cpu_models(device, dtype, flag, mode):
    class Cfg:
        vocab_size, max_position_embeddings = 100, 256

    args = EngineArgs(device=device, dtype=dtype, cpu_int4_matmul=flag)
    assert args.create_engine_config(Cfg()).cpu_int4_matmul == mode
