"""Latent attention (MLA) through both backends' forward_mla: the Triton backend (kernels in
the interpreter on the CPU) against the torch reference backend, on mixed steps (decodes,
prefill chunks after cached context, fresh prompts) and on decode graph metadata with padded
rows; and both against a dense per-request softmax."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from shoal.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V_DIM, ROPE, BS = 32, 16, 4


def _dense(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, Dk] at the last n positions of rows [S, Dk]: causal softmax attention."""
    s, n = rows.shape[0], q.shape[0]
    scores = torch.einsum("nhd,sd->hns", q.double(), rows.double()) * scale
    pos = torch.arange(s - n, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
    return torch.einsum("hns,sd->nhd", scores.softmax(-1), rows[:, :V_DIM].double())


def _step(query_lens: list[int], context_lens: list[int], num_decodes: int, heads: int,
          seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for q, c in zip(query_lens, context_lens):
        tables.append([free.pop() for _ in range(-(-(q + c) // BS))])
    cache = torch.randn(1, (num_blocks + 1) * BS, 1, V_DIM + ROPE, generator=gen)
    cache[:, num_blocks * BS:] = 0  # the null block
    t = sum(query_lens)
    q = torch.randn(t, heads, V_DIM + ROPE, generator=gen)
    latent = torch.randn(t, V_DIM + ROPE, generator=gen)
    return tables, cache, q, latent, num_blocks


@pytest.mark.parametrize("heads", [3, 16])
def test_mixed_step_matches_torch_backend_and_dense(heads: int) -> None:
    query_lens, context_lens, nd = [1, 1, 1, 5, 9, 7], [0, 6, 13, 0, 4, 11], 3
    tables, cache, q, latent, nb = _step(query_lens, context_lens, nd, heads, seed=heads)
    scale = (V_DIM + ROPE) ** -0.5
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        kv = cache.clone().to(DEV)
        md = backend.build_metadata(query_lens=query_lens, context_lens=context_lens,
                                    block_tables=tables, block_size=BS, num_decodes=nd,
                                    sliding_window=None, device=DEV, null_block=nb)
        outs.append(backend.forward_mla(q.to(DEV), latent.to(DEV), kv, md, scale, V_DIM).cpu())
        caches.append(kv.cpu())
    torch.testing.assert_close(caches[0], caches[1])
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    start = 0
    for qlen, ctx, table in zip(query_lens, context_lens, tables):
        slots = [table[p // BS] * BS + p % BS for p in range(ctx + qlen)]
        rows = caches[0][0, slots, 0]
        want = _dense(q[start:start + qlen], rows, scale).float()
        torch.testing.assert_close(outs[0][start:start + qlen], want, atol=2e-5, rtol=2e-5)
        start += qlen


def test_decode_graph_metadata_with_padded_rows() -> None:
    """The metadata decode CUDA graphs replay: rows past the batch are padding (seq_len 0,
    slot -1), which must write nothing and read nothing."""
    backend = TritonAttentionBackend()
    context_lens = [5, 17, 2]
    tables, cache, q, latent, nb = _step([1, 1, 1], context_lens, 3, heads=4, seed=7)
    buf = backend.alloc_graph_buffers(8, 8, 8, DEV, block_size=BS, sliding_window=None)
    slots = [t[c // BS] * BS + c % BS for t, c in zip(tables, context_lens)]
    backend.fill_graph_buffers(buf, 4, 1, context_lens, tables, slots)
    md = backend.graph_metadata(buf, 4, 1)
    scale = 0.2
    kv = cache.clone().to(DEV)
    qp = torch.cat([q, torch.randn(1, 4, V_DIM + ROPE)]).to(DEV)
    lp = torch.cat([latent, torch.randn(1, V_DIM + ROPE)]).to(DEV)
    got = backend.forward_mla(qp, lp, kv, md, scale, V_DIM).cpu()
    ref_kv = cache.clone()
    ref = TorchAttentionBackend()
    rmd = ref.build_metadata(query_lens=[1, 1, 1], context_lens=context_lens,
                             block_tables=tables, block_size=BS, num_decodes=3,
                             sliding_window=None, device=torch.device("cpu"), null_block=nb)
    want = ref.forward_mla(q, latent, ref_kv, rmd, scale, V_DIM)
    torch.testing.assert_close(got[:3], want, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(got[3]) == 0
    torch.testing.assert_close(kv.cpu(), ref_kv)  # the padded row wrote nothing
