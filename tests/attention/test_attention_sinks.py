"""Attention sinks (gpt-oss: one learned logit per query head in the softmax's denominator,
no value): the torch backend against a dense per-sequence definition, with and without a
sliding window, and the Triton kernels against the torch backend (in the interpreter on the
CPU, see conftest.py): decodes with split-K and padded rows, chunked prefills, windows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import build_attention_metadata
from shoal.attention.packed import PackedSeqs
from shoal.attention.torch_backend import TorchAttentionBackend, paged_attention
from shoal.layers.attention import Attention

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Seq:
    ctx: int  # tokens already in the cache
    q: int  # new tokens this step


@dataclass
class Step:
    """One step's random inputs over a randomly laid out cache (the last block is null)."""

    seqs: list[Seq]
    tables: list[list[int]]
    cache: torch.Tensor  # [2, slots, Hk, D]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor
    null_block: int
    bs: int

    def kwargs(self, num_decodes: int, window: int | None) -> dict:
        return dict(query_lens=[s.q for s in self.seqs], context_lens=[s.ctx for s in self.seqs],
                    block_tables=self.tables, block_size=self.bs, num_decodes=num_decodes,
                    sliding_window=window, device=DEV)


def make_step(seqs: list[Seq], hq: int, hk: int, d: int, bs: int, seed: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s.ctx + s.q) // bs) for s in seqs]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    cache = torch.randn(2, (nb + 1) * bs, hk, d, generator=gen)
    cache[:, nb * bs:] = 0
    t = sum(s.q for s in seqs)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hk, hk))
    sinks = torch.randn(hq, generator=gen) * 2  # some heads' sinks dominate, some vanish
    return Step(seqs, tables, cache.to(DEV), q.to(DEV), k.to(DEV), v.to(DEV), sinks.to(DEV),
                nb, bs)


def dense_reference(step: Step, window: int | None, scale: float) -> torch.Tensor:
    """Each sequence on its own in float64: keys = its cached ones, then the new ones; query
    i at position ctx + i sees keys (pos - window, pos]; the sink joins the denominator."""
    outs, start = [], 0
    hq, hk = step.q.shape[1], step.k.shape[1]
    g = hq // hk
    for s, table in zip(step.seqs, step.tables):
        slots = [table[p // step.bs] * step.bs + p % step.bs for p in range(s.ctx)]
        kc = torch.cat([step.cache[0, slots], step.k[start:start + s.q]]).double()
        vc = torch.cat([step.cache[1, slots], step.v[start:start + s.q]]).double()
        q = step.q[start:start + s.q].double()
        kc, vc = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)  # [S, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, kc) * scale
        qpos = torch.arange(s.ctx, s.ctx + s.q)[:, None]
        kpos = torch.arange(s.ctx + s.q)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        scores = scores.masked_fill(~allowed.to(DEV), float("-inf"))
        sink = step.sinks.double()[:, None, None].expand(hq, s.q, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, vc))
        start += s.q
    return torch.cat(outs).float()


MIXED = [Seq(9, 1), Seq(0, 1), Seq(14, 1),  # decodes
         Seq(11, 5), Seq(0, 12), Seq(3, 5), Seq(0, 1)]  # a chunk after context, fresh prompts


@pytest.mark.parametrize("window", [None, 4, 7])
@pytest.mark.parametrize(("hq", "hk"), [(8, 2), (2, 2)], ids=["gqa4", "mha"])
def test_torch_backend_matches_the_definition(window: int | None, hq: int, hk: int) -> None:
    step = make_step(MIXED, hq, hk, 16, 4, seed=hq + (window or 0))
    scale = 16 ** -0.5
    md = build_attention_metadata(**step.kwargs(3, window), null_block=step.null_block)
    if window is None:
        assert md.fresh_spans  # the whole-prompt path is covered too
    got = paged_attention(step.q, step.k, step.v, step.cache.clone(), md, scale,
                          sinks=step.sinks)
    torch.testing.assert_close(got, dense_reference(step, window, scale), atol=1e-5, rtol=1e-5)


def test_sinks_change_the_output_and_zero_weight_sinks_do_not() -> None:
    """A sink of -inf is no sink (SDPA's answer); a large one takes the attention's mass."""
    step = make_step(MIXED, 4, 2, 16, 4, seed=3)
    md = build_attention_metadata(**step.kwargs(3, None), null_block=step.null_block)
    plain = paged_attention(step.q, step.k, step.v, step.cache.clone(), md, 0.25,
                            decode_kernel=False)
    none = paged_attention(step.q, step.k, step.v, step.cache.clone(), md, 0.25,
                           sinks=torch.full((4,), float("-inf"), device=DEV))
    torch.testing.assert_close(none, plain, atol=1e-6, rtol=1e-5)
    big = paged_attention(step.q, step.k, step.v, step.cache.clone(), md, 0.25,
                          sinks=torch.full((4,), 40.0, device=DEV))
    assert big.abs().max() < 1e-6


class _NoSinks(TorchAttentionBackend):
    name = "nosinks"
    supports_sinks = False


def test_a_backend_without_sinks_refuses_them() -> None:
    layer = Attention(4, 2, 16)
    layer.backend = _NoSinks()
    assert isinstance(layer.backend, AttentionBackend)
    layer.kv_cache = torch.zeros(2, 8, 2, 16)
    step = make_step([Seq(0, 3)], 4, 2, 16, 4, seed=4)
    md = build_attention_metadata(**step.kwargs(0, None), null_block=1)
    with pytest.raises(NotImplementedError, match="no attention sinks"):
        layer(step.q, step.k, step.v, md, sinks=step.sinks)
    layer.backend = TorchAttentionBackend()
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        layer(step.q, step.k, step.v, md, sinks=step.sinks[:2])


def test_pooling_steps_take_sinks_too() -> None:
    """A causal model with sinks run as an embedder: packed prompts, no cache."""
    step = make_step([Seq(0, 3), Seq(0, 5), Seq(0, 5)], 4, 2, 16, 4, seed=5)
    layer = Attention(4, 2, 16)
    seqs = PackedSeqs.build([3, 5, 5], causal=True, device=DEV)
    got = layer(step.q, step.k, step.v, seqs, sinks=step.sinks)
    torch.testing.assert_close(got, dense_reference(step, None, layer.scale), atol=1e-5,
                               rtol=1e-5)


# ---- Triton kernels against the torch backend ------------------------------------------------

triton = pytest.importorskip("triton")

from shoal.attention.triton_backend import (  # noqa: E402
    build_triton_attention_metadata,
    paged_attention_triton,
)


def run_triton(seqs: list[Seq], num_decodes: int, hq: int, hk: int, d: int, bs: int, *,
               window: int | None = None, seed: int = 0, num_splits: int | None = None,
               pad_decodes_to: int | None = None, width: int | None = None) -> None:
    step = make_step(seqs, hq, hk, d, bs, seed)
    scale = 1 / math.sqrt(d)
    md = build_attention_metadata(**step.kwargs(num_decodes, window), null_block=step.null_block)
    ref = paged_attention(step.q, step.k, step.v, step.cache.clone(), md, scale,
                          sinks=step.sinks)
    tmd = build_triton_attention_metadata(**step.kwargs(num_decodes, window),
                                          pad_decodes_to=pad_decodes_to,
                                          decode_num_splits=num_splits, block_table_width=width)
    q, k, v = step.q, step.k, step.v
    n_pad = tmd.num_decode_rows - num_decodes
    if n_pad:  # padded decode rows between the real decodes and the prefills
        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:num_decodes], torch.randn_like(x[:n_pad]), x[num_decodes:]])
        q, k, v = padded(q), padded(k), padded(v)
    out = paged_attention_triton(q, k, v, step.cache.clone(), tmd, scale, step.sinks)
    real = torch.cat([out[:num_decodes], out[tmd.num_decode_rows:]])
    torch.testing.assert_close(real, ref, atol=2e-5, rtol=2e-5)
    if n_pad:
        assert torch.all(out[num_decodes:tmd.num_decode_rows] == 0)


@pytest.mark.parametrize("window", [None, 5])
def test_triton_mixed_step(window: int | None) -> None:
    run_triton(MIXED, 3, 8, 2, 64, 4, window=window, seed=11)


@pytest.mark.parametrize("splits", [1, 4])
def test_triton_split_k_decode_with_padding(splits: int) -> None:
    # A long context over several splits, a short one leaving splits empty (only split 0
    # carries the sink), padded rows that must stay zero.
    run_triton([Seq(200, 1), Seq(3, 1)], 2, 4, 2, 64, 16, seed=12, num_splits=splits,
               pad_decodes_to=4, width=16)


def test_triton_split_k_with_window() -> None:
    run_triton([Seq(150, 1), Seq(9, 1)], 2, 4, 1, 64, 16, window=70, seed=13, num_splits=4)


def test_triton_prefill_chunks_with_window() -> None:
    run_triton([Seq(6, 9), Seq(0, 11), Seq(40, 3)], 0, 6, 2, 64, 16, window=8, seed=14)
