"""The fused decode kernels of linear attention (shoal/layers/ops/linear_decode_fused.py) on a
GPU (skipped without one) at the shipped shapes: Kimi-Linear-48B's KDA, Qwen3.5-35B-A3B's and
Qwen3.5-27B's Gated DeltaNet, Qwen3-Next-80B's (interleaved projections), bf16, pages laid out
as the engine lays them. Four decode steps in a row from non-zero states, rows moving to new
blocks and in place, a padding row (null block in, trash block out): the layer's outputs and
states against its torch decode path and its older two-kernel path. Then each layer's device
time a decode step inside a CUDA graph (projections included) through each path and kernel
variant, printed (run with -s):

    .venv/bin/python -m pytest -q -s tests/layers/test_linear_decode_fused_gpu.py"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from gpu_timing import graph_of_calls, time_ms  # noqa: E402
from layers.test_linear_decode_fused import SHIPPED, _hidden, shipped_layer  # noqa: E402

from shoal.attention.linear_state import StateMetadata, StatePages  # noqa: E402
from shoal.layers import linear_attention  # noqa: E402
from shoal.layers.ops import cpu_linear_state, linear_decode_fused  # noqa: E402

BLOCKS = 12
NULL, TRASH = 0, BLOCKS - 1


def _layer(name: str):
    layer, cache, bs = shipped_layer(name, torch.bfloat16, "cuda", BLOCKS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # outputs of unit scale: matrices N(0, 1 / fan_in)
        for pname, p in layer.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.3)
            elif pname.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen, device="cuda") * 2 - 4)
            elif p.dim() == 1 or pname.endswith("conv1d.weight"):
                p.copy_(torch.rand(p.shape, generator=gen, device="cuda") + 0.5
                        if p.dim() == 1 else
                        torch.randn(p.shape, generator=gen, device="cuda") * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[1] ** -0.5)
    return layer, cache, bs, gen


def _path(monkeypatch, path: str, **variant) -> None:
    """'fused' (with a kernel variant), 'in_place' (the two older kernels) or 'torch'."""
    monkeypatch.setattr(linear_attention, "triton_decode", lambda x: path != "torch")
    monkeypatch.setattr(linear_attention, "fused_decode_enabled", lambda: path == "fused")
    monkeypatch.setattr(cpu_linear_state, "usable", lambda x: False)
    real = _real_decode_step

    def forced(*args, **kwargs):  # (the variant's arguments over the layer's)
        return real(*args, **{**kwargs, **variant})
    monkeypatch.setattr(linear_decode_fused, "decode_step", forced)


_real_decode_step = linear_decode_fused.decode_step


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("name", SHIPPED)
def test_fused_decode_matches_the_torch_path(name: str, batch: int, monkeypatch):
    layer, cache, bs, gen = _layer(name)
    layer.bind_pages(cache, bs)
    pages = layer.pages
    heads, dk, dv = pages.state_shape
    blocks = list(range(1, 1 + batch))
    start = torch.tensor(blocks, device="cuda")
    pages.write(start, torch.randn(batch, *pages.conv_shape, generator=gen,
                                   device="cuda").bfloat16().float(),
                torch.randn(batch, heads, dk, dv, generator=gen, device="cuda") * 0.05)
    caches = {p: cache.clone() for p in ("torch", "in_place", "fused")}
    hidden_size = _hidden(layer)
    # row 0 crosses into a new block every other step, in place between; the other rows
    # stay in theirs; one padding row reads the null block and writes the trash block
    read, fresh = blocks, batch + 1
    for step in range(4):
        write = list(read)
        if step % 2:
            write[0], fresh = fresh, fresh + 1
        md = StateMetadata(batch + 1, torch.tensor(read + [NULL], device="cuda"),
                           torch.tensor(write + [TRASH], device="cuda"), [], bs)
        hidden = torch.randn(batch + 1, hidden_size, generator=gen, device="cuda").bfloat16()
        outs = {}
        for path, c in caches.items():
            _path(monkeypatch, path)
            layer.bind_pages(c, bs)
            with torch.no_grad():
                outs[path] = layer(hidden, md).float()
        want = outs["torch"]
        for path in ("in_place", "fused"):
            torch.testing.assert_close(outs[path], want, atol=3e-2, rtol=3e-2)
        ref = StatePages(caches["torch"], bs, pages.conv_shape, pages.state_shape)
        got = StatePages(caches["fused"], bs, pages.conv_shape, pages.state_shape)
        conv_ref, state_ref = ref.read(md.decode_write)
        conv, state = got.read(md.decode_write)
        assert torch.equal(conv, conv_ref)
        torch.testing.assert_close(state, state_ref, atol=5e-3, rtol=5e-3)
        null_conv, null_state = got.read(torch.tensor([NULL], device="cuda"))
        assert not null_conv.any() and not null_state.any()
        read = write


@pytest.mark.parametrize("name", SHIPPED)
def test_decode_step_times(name: str, monkeypatch):
    """Device time of one layer's decode step (in-projections to out-projection) inside a
    CUDA graph, batch 1 and 8, through each path: printed, and the fused default must beat
    the older path."""
    layer, cache, bs, gen = _layer(name)
    layer.bind_pages(cache, bs)
    variants = {"torch": ("torch", {}), "in_place": ("in_place", {}), "fused": ("fused", {}),
                "fused w4": ("fused", {"num_warps": 4}), "fused w8": ("fused", {"num_warps": 8}),
                "fused w16": ("fused", {"num_warps": 16}),
                "fused late states": ("fused", {"early_states": False})}
    hidden_size = _hidden(layer)
    for batch in (1, 8):
        blocks = torch.arange(1, 1 + batch, device="cuda")
        md = StateMetadata(batch, blocks, blocks, [], bs)
        hidden = torch.randn(batch, hidden_size, generator=gen, device="cuda").bfloat16()
        times = {}
        for label, (path, variant) in variants.items():
            _path(monkeypatch, path, **variant)

            def step(hidden=hidden, md=md):
                with torch.no_grad():
                    return layer(hidden, md)
            replay, calls = graph_of_calls(step)
            times[label] = time_ms(replay, iters=20) / calls * 1e3
        print(f"\n{name} batch {batch}: " + ", ".join(f"{k} {v:.1f} us" for k, v in
                                                     times.items()))
        assert times["fused"] < times["in_place"]
