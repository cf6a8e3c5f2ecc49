"""Programmatic dependent launch (shoal/pdl.py; skipped without an sm_90 GPU): a
decode layer's chain of Triton kernels (norm, FP8 GEMVs with and without a K split, SiLU-mul,
rope and cache write, paged decode with its split reduce, the INT4 GEMVs that launch plainly
between them, and the bf16 GEMVs of half_gemv.py) captured in a CUDA graph with PDL
gives bit for bit what the same kernels give launched plainly (SHOAL_PDL=0), replay after
replay, with each replay's inputs changed in place; and the switch reaches the launches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm_90+ CUDA GPU")

from shoal import pdl  # noqa: E402
from shoal.attention.ops.paged_decode import paged_decode  # noqa: E402
from shoal.attention.ops.rope_kv_write import rope_kv_write  # noqa: E402
from shoal.layers.ops.half_gemv import HalfGemvTile, half_gemv  # noqa: E402
from shoal.layers.ops.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from shoal.layers.ops.silu_mul import silu_and_mul  # noqa: E402
from shoal.layers.quantization.decode_gemv import GemvTiles, fp8_gemv, int4_gemv  # noqa: E402

H, INTER, HEADS, KV_HEADS, D, BLOCK, CONTEXT = 1024, 2048, 8, 2, 128, 16, 300


def _weights(dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)

    def fp8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(n, k, device=dev, generator=g) * 0.05).to(torch.float8_e4m3fn)
        return w, torch.rand(n, device=dev, generator=g) * 0.1 + 0.01
    qkv = fp8((HEADS + 2 * KV_HEADS) * D, H)
    o = fp8(H, HEADS * D)
    up = fp8(2 * INTER, H)
    codes = torch.randint(-2**31, 2**31 - 1, (INTER // 8, H), device=dev, generator=g,
                          dtype=torch.int32)
    scales = (torch.rand(INTER // 128, H, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    half = D // 2
    inv = 1.0 / 10000 ** (torch.arange(half, device=dev) / half)
    ang = torch.arange(4096, device=dev)[:, None] * inv[None, :]
    dense = (torch.randn(INTER, H, device=dev, generator=g) * 0.05).to(torch.bfloat16)
    return dict(half=dense, qkv=qkv[0], qkv_s=qkv[1], o=o[0], o_s=o[1], up=up[0], up_s=up[1],
                codes=codes, scales=scales, norm=torch.rand(H, device=dev, generator=g).to(torch.bfloat16),
                cos_sin=torch.cat([ang.cos(), ang.sin()], 1))


def _layer(w: dict[str, torch.Tensor], x: torch.Tensor, res: torch.Tensor, cache: torch.Tensor,
           tables: torch.Tensor, seq_lens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor
           ) -> torch.Tensor:
    h, r = fused_add_rms_norm(x, res, w["norm"], 1e-6)
    qkv = fp8_gemv(h, w["qkv"], w["qkv_s"], GemvTiles(8, 512, 1))
    q = qkv[:, :HEADS * D].view(1, HEADS, D)
    k = qkv[:, HEADS * D:(HEADS + KV_HEADS) * D].view(1, KV_HEADS, D)
    v = qkv[:, (HEADS + KV_HEADS) * D:].view(1, KV_HEADS, D)
    rope_kv_write(pos, q, k, v, w["cos_sin"], cache, slots)
    att = paged_decode(q, cache, tables, seq_lens, BLOCK, D ** -0.5, num_splits=4)
    o = fp8_gemv(att.reshape(1, HEADS * D), w["o"], w["o_s"], GemvTiles(16, 256, 2))
    h2 = rms_norm(o + r, w["norm"], 1e-6)
    a = silu_and_mul(fp8_gemv(h2, w["up"], w["up_s"], GemvTiles(8, 512, 1)))
    down = int4_gemv(a, w["codes"], w["scales"], None, 128,
                     GemvTiles(256, 64, 4, num_warps=1, num_stages=1, kernel="wide"))
    strip = int4_gemv(a, w["codes"], w["scales"], None, 128, GemvTiles(64, 64, 1))
    # the bf16 GEMVs: early weights (prefetch), and a K split with its summing kernel
    early = half_gemv(h2, w["half"], None, HalfGemvTile(4, 1024, 1, prefetch=True))
    split = half_gemv(early[:, :H], w["half"], None, HalfGemvTile(8, 512, 4))
    return torch.cat([down, strip, att.reshape(1, -1), early, split], 1)


def _inputs(dev: torch.device, step: int) -> list[torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(100 + step)
    x = torch.randn(1, H, device=dev, generator=g).to(torch.bfloat16)
    res = torch.randn(1, H, device=dev, generator=g).to(torch.bfloat16)
    cache = (torch.randn(2, 64 * BLOCK, KV_HEADS, D, device=dev, generator=g) * 0.5).to(
        torch.bfloat16)
    tables = torch.randperm(64, device=dev, generator=g)[:32].to(torch.int32)[None, :]
    seq = CONTEXT + step
    seq_lens = torch.tensor([seq], dtype=torch.int32, device=dev)
    pos = torch.tensor([seq - 1], dtype=torch.int64, device=dev)
    slots = (tables[0, (seq - 1) // BLOCK].long() * BLOCK + (seq - 1) % BLOCK).reshape(1)
    return [x, res, cache, tables, seq_lens, pos, slots]


def test_the_switch_reaches_the_launches(monkeypatch) -> None:
    dev = torch.device("cuda")
    monkeypatch.setenv("SHOAL_PDL", "0")
    assert pdl.kwargs(dev) == {} and pdl.kwargs(torch.device("cpu")) == {}
    monkeypatch.delenv("SHOAL_PDL", raising=False)  # on by default
    assert pdl.HAVE_GDC and pdl.kwargs(dev) == {"PDL": True, "launch_pdl": True}
    assert pdl.kwargs(torch.device("cpu")) == {}


def test_a_layer_graph_with_pdl_equals_plain_launches(monkeypatch) -> None:
    dev = torch.device("cuda")
    w = _weights(dev)
    monkeypatch.setenv("SHOAL_PDL", "0")
    want = []
    for step in range(3):
        inp = _inputs(dev, step)
        want.append((_layer(w, *inp).clone(), inp[2].clone()))
        assert torch.isfinite(want[-1][0]).all()  # (torch.equal fails on a nan)
    monkeypatch.setenv("SHOAL_PDL", "1")
    eager = _inputs(dev, 0)
    assert torch.equal(_layer(w, *eager), want[0][0])  # PDL launches, eager
    static = _inputs(dev, 0)
    _layer(w, *[t.clone() for t in static])  # compiles the PDL kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(w, *static)
    for step in range(3):
        for dst, src in zip(static, _inputs(dev, step)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[step][0]), step
        assert torch.equal(static[2], want[step][1]), step  # the cache write
