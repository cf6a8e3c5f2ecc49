"""Triton kernels vs the PyTorch reference, run on the CPU through the Triton interpreter
(see conftest.py; compiled on a GPU).

Shapes are tiny (the interpreter executes each program in Python) but the tile sizes are the
GPU ones, so the masking of ragged tiles, block boundaries, split-K and padding is exercised
as on the device."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.metadata import build_attention_metadata  # noqa: E402
from shoal.attention.ops.kv_cache_write import write_kv_cache  # noqa: E402
from shoal.attention.ops.paged_decode import choose_num_splits, paged_decode  # noqa: E402
from shoal.attention.torch_backend import paged_attention  # noqa: E402
from shoal.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    build_triton_attention_metadata,
    paged_attention_triton,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class Seq:
    ctx: int  # tokens already in the cache
    q: int  # new tokens this step


def run_attention(seqs: list[Seq], num_decodes: int, hq: int, hk: int, d: int, bs: int, *,
                  window: int | None = None, dtype: torch.dtype = torch.float32,
                  seed: int = 0, pad_decodes_to: int | None = None,
                  num_splits: int | None = None, width: int | None = None) -> torch.Tensor:
    """One step through paged_attention_triton vs the torch backend (in fp32) on the same
    randomly filled, randomly laid out cache; also checks the cache writes. Returns the
    Triton output."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s.ctx + s.q) // bs) for s in seqs]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    # Finite garbage everywhere except the reference's null block (the extra last block).
    cache = torch.randn(2, (nb + 1) * bs, hk, d, generator=gen).to(DEV, dtype)
    cache[:, nb * bs:] = 0
    t = sum(s.q for s in seqs)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(DEV, dtype) for h in (hq, hk, hk))
    kw = dict(query_lens=[s.q for s in seqs], context_lens=[s.ctx for s in seqs],
              block_tables=tables, block_size=bs, num_decodes=num_decodes,
              sliding_window=window, device=DEV)
    ref_cache = cache.float()
    md = build_attention_metadata(**kw, null_block=nb)
    scale = 1 / math.sqrt(d)
    ref = paged_attention(q.float(), k.float(), v.float(), ref_cache, md, scale)

    tmd = build_triton_attention_metadata(**kw, pad_decodes_to=pad_decodes_to,
                                          decode_num_splits=num_splits, block_table_width=width)
    n_pad = tmd.num_decode_rows - num_decodes
    if n_pad:  # padded rows: tokens [num_decodes, num_decode_rows), arbitrary queries
        def padded(x: torch.Tensor) -> torch.Tensor:
            fill = torch.randn(n_pad, *x.shape[1:], generator=gen).to(DEV, dtype)
            return torch.cat([x[:num_decodes], fill, x[num_decodes:]])
        q, k, v = padded(q), padded(k), padded(v)
    out = paged_attention_triton(q, k, v, cache, tmd, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(cache, ref_cache.to(dtype)), "cache writes differ"
    real = torch.cat([out[:num_decodes], out[tmd.num_decode_rows:]])
    tol = TOL[dtype]
    torch.testing.assert_close(real.float(), ref, atol=tol, rtol=tol)
    if n_pad:
        assert torch.all(out[num_decodes:tmd.num_decode_rows] == 0)
    return out


MIXED = [Seq(9, 1), Seq(0, 1), Seq(7, 1),  # decodes: one-token, ends on a block boundary
         Seq(11, 5), Seq(0, 12), Seq(3, 5), Seq(8, 1)]  # chunk after context, first chunk,
#                                                  ends on a boundary, one-token chunk


@pytest.mark.parametrize(("hq", "hk"), [(8, 2), (2, 2)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("d", [64, 128])
def test_mixed_step(hq: int, hk: int, d: int) -> None:
    run_attention(MIXED, 3, hq, hk, d, 4, seed=d + hq)


@pytest.mark.parametrize("bs", [4, 16])
def test_block_size_16_and_boundaries(bs: int) -> None:
    seqs = [Seq(bs - 1, 1), Seq(2 * bs - 1, 1), Seq(bs, 2 * bs), Seq(0, bs), Seq(bs + 1, 1)]
    run_attention(seqs, 2, 4, 2, 64, bs, seed=bs)


def test_decodes_only() -> None:
    run_attention([Seq(5, 1), Seq(0, 1), Seq(15, 1), Seq(16, 1)], 4, 4, 1, 64, 4, seed=1)


def test_prefills_only() -> None:
    run_attention([Seq(0, 7), Seq(0, 1), Seq(6, 9)], 0, 6, 2, 64, 4, seed=2)  # group of 3


def test_single_token_sequence_alone() -> None:
    run_attention([Seq(0, 1)], 1, 4, 2, 64, 16, seed=3)
    run_attention([Seq(0, 1)], 0, 4, 2, 64, 16, seed=4)


@pytest.mark.parametrize("window", [1, 5, 70])
def test_sliding_window(window: int) -> None:
    # Prefill with a long context: whole 64-key tiles before the chunk take the unmasked path.
    seqs = [Seq(10, 1), Seq(2, 1), Seq(130, 1), Seq(6, 9), Seq(0, 11), Seq(100, 3)]
    run_attention(seqs, 3, 4, 2, 64, 16, window=window, seed=5)


def test_long_prefill_several_query_tiles() -> None:
    # 70 queries x 2 heads fill more than one 128-row tile; 80 cached keys give one whole
    # unmasked key tile before the diagonal.
    run_attention([Seq(80, 70), Seq(0, 3)], 0, 2, 1, 64, 16, seed=6)


@pytest.mark.parametrize("splits", [None, 3, 4])
def test_split_k_decode(splits: int | None) -> None:
    # A long context cut into partitions, a short one leaving splits empty, an empty one.
    seqs = [Seq(300, 1), Seq(5, 1), Seq(64, 1)]
    run_attention(seqs, 3, 4, 2, 64, 16, seed=7, num_splits=splits)


def test_split_k_with_window_and_padding() -> None:
    seqs = [Seq(200, 1), Seq(3, 1)]
    run_attention(seqs, 2, 4, 2, 64, 16, window=70, seed=8, num_splits=4, pad_decodes_to=4,
                  width=32)


@pytest.mark.parametrize("splits", [1, 2])
def test_padded_decode_rows_with_prefill(splits: int) -> None:
    # CUDA-graph style padding: 2 real decodes padded to 5 rows, fixed table width, then a
    # prefill whose tokens follow the padded rows.
    run_attention([Seq(9, 1), Seq(4, 1), Seq(2, 6)], 2, 4, 2, 64, 4, seed=9,
                  pad_decodes_to=5, num_splits=splits, width=8)


BF16_DOT = pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot does not support "
                              "bf16 (triton-lang/triton#11584); runs on a GPU")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_DOT), torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    run_attention(MIXED, 3, 4, 2, 128, 4, dtype=dtype, seed=10)


def test_head_dim_256() -> None:
    run_attention([Seq(40, 1), Seq(5, 4)], 1, 2, 1, 256, 16, seed=11, num_splits=2)


def test_graph_buffers_replay_steps() -> None:
    """The CUDA-graph hooks: one metadata object over persistent buffers, refilled per step
    (fewer rows the second time, so stale rows must be harmless), matches the reference."""
    gen = torch.Generator().manual_seed(16)
    bs, hq, hk, d, nb = 4, 4, 2, 64, 24
    backend = TritonAttentionBackend()
    buf = backend.alloc_graph_buffers(4, 4, 8, DEV, block_size=bs, sliding_window=None)
    md = backend.graph_metadata(buf, 4, 1)
    backend.fill_graph_buffers(buf, 4, 1, [], [], [])  # as at capture: all rows padding
    cache = torch.randn(2, (nb + 1) * bs, hk, d, generator=gen).to(DEV)
    cache[:, nb * bs:] = 0
    qkv = torch.randn(4, hq + 2 * hk, d, generator=gen).to(DEV)
    out = backend.forward(qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], cache.clone(), md, 0.1)
    assert torch.all(out == 0)
    for ctx, tables in (([9, 0, 20], [[3, 7, 1], [5], [0, 2, 4, 6, 8, 10]]), ([2], [[11]])):
        n = len(ctx)
        slots = [t[c // bs] * bs + c % bs for c, t in zip(ctx, tables)]
        backend.fill_graph_buffers(buf, 4, 1, ctx, tables, slots)
        q = torch.randn(4, hq, d, generator=gen).to(DEV)
        k, v = (torch.randn(4, hk, d, generator=gen).to(DEV) for _ in range(2))
        got_cache = cache.clone()
        got = backend.forward(q, k, v, got_cache, md, 0.1)
        ref_md = build_attention_metadata(query_lens=[1] * n, context_lens=ctx,
                                          block_tables=tables, block_size=bs, num_decodes=n,
                                          sliding_window=None, device=DEV, null_block=nb)
        ref_cache = cache.clone()
        ref = paged_attention(q[:n], k[:n], v[:n], ref_cache, ref_md, 0.1)
        torch.testing.assert_close(got[:n], ref, atol=2e-5, rtol=2e-5)
        assert torch.all(got[n:] == 0) and torch.equal(got_cache, ref_cache)


def test_backend_build_metadata_takes_runner_kwargs() -> None:
    md = TritonAttentionBackend().build_metadata(
        query_lens=[1, 3], context_lens=[4, 0], block_tables=[[2, 0], [1]], block_size=4,
        num_decodes=1, sliding_window=None, device=DEV, null_block=9)
    assert md.seq_lens.tolist() == [5, 3] and md.query_start_loc.tolist() == [0, 1, 4]
    assert md.block_tables.dtype == torch.int32 and md.block_tables.tolist() == [[2, 0], [1, 0]]
    assert md.slot_mapping.tolist() == [0, 4, 5, 6]  # position 4 of [2, 0] is block 0


def test_choose_num_splits() -> None:
    assert choose_num_splits(64, 8, 512) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 512) == 4  # limited by MIN_SPLIT_TOKENS
    assert choose_num_splits(1, 8, 32768) == 32  # one to two waves, a power of two
    assert choose_num_splits(16, 8, 32768) == 2
    assert choose_num_splits(1, 8, 0) == 1


def test_decode_wrapper_rejects_bad_inputs() -> None:
    q = torch.randn(2, 4, 64, device=DEV)
    cache = torch.zeros(2, 32, 2, 64, device=DEV)
    bt = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    lens = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(q, cache, bt.long(), lens, 4, 0.1)
    with pytest.raises(ValueError, match="head dim"):
        paged_decode(q[..., :48], cache[..., :48], bt, lens, 4, 0.1)
    with pytest.raises(ValueError, match="dtype|bf16"):
        paged_decode(q.bfloat16(), cache, bt, lens, 4, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_strided_and_padding_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    t, hk, d = 5, 2, 64
    qkv = torch.randn(t, (4 + 2 * hk) * d, generator=gen).to(DEV, dtype)  # k, v: fused views
    k = qkv[:, 4 * d:(4 + hk) * d].view(t, hk, d)
    v = qkv[:, (4 + hk) * d:].view(t, hk, d)
    cache = torch.randn(2, 24, hk, d, generator=gen).to(DEV, dtype)
    slots = torch.tensor([7, -1, 0, 23, -1], device=DEV)
    expect = cache.clone()
    ok = slots >= 0
    expect[0, slots[ok]] = k[ok]
    expect[1, slots[ok]] = v[ok]
    write_kv_cache(cache, k, v, slots)
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("sms", [16, 4096])
def test_short_chunk_over_long_context_with_shorter_query_tiles(sms: int, monkeypatch) -> None:
    # The occupancy heuristic (a GPU's SM count) cuts query tiles down to 16 rows when the
    # grid is small: a GQA group of 4 then holds 4 tokens per tile, and the chunk's tiles
    # each read the whole 200-token context.
    from shoal.attention.ops import paged_prefill as pp

    monkeypatch.setattr(pp, "_num_sms", lambda device: sms)
    run_attention([Seq(200, 37), Seq(64, 5)], 0, 8, 2, 64, 16, seed=11)
