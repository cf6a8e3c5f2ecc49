"""The graph metadata of shapes of q > 1 tokens per row (speculative decoding's verify steps, a
lone prefill chunk): requests padded to a graph's rows (and a chunk padded to its q) give,
for their real tokens, the attention and cache writes of the eager metadata, for ordinary
and latent (MLA) attention; padding writes nothing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    latent_attention_triton,
    paged_attention_triton,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS, Q = 4, 3  # block size; two drafts + the last token


def _layout(context_lens: list[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    need = [-(-(c + Q) // BS) for c in context_lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    return tables, nb


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_padded_verify_graph_metadata_matches_eager(latent: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    backend = TritonAttentionBackend()
    context_lens = [5, 0, 12]
    tables, nb = _layout(context_lens, gen)
    slots = [t[p // BS] * BS + p % BS for t, c in zip(tables, context_lens)
             for p in range(c, c + Q)]
    n, size = len(context_lens), 4
    buf = backend.alloc_graph_buffers(8, 8 * Q, 8, DEV, block_size=BS, sliding_window=None)
    backend.fill_graph_buffers(buf, size, Q, context_lens, tables, slots)
    graph_md = backend.graph_metadata(buf, size, Q)
    eager_md = backend.build_metadata(query_lens=[Q] * n, context_lens=context_lens,
                                      block_tables=tables, block_size=BS, num_decodes=0,
                                      sliding_window=None, device=DEV, null_block=nb)
    t_real, t_all = n * Q, size * Q
    if latent:
        cache = torch.randn(1, (nb + 1) * BS, 1, 48, generator=gen).to(DEV)
        q = torch.randn(t_all, 4, 48, generator=gen).to(DEV)
        lat = torch.randn(t_all, 48, generator=gen).to(DEV)

        def attend(c, md, rows):
            return latent_attention_triton(q[:rows], lat[:rows], c, md, 0.3, 32)
    else:
        cache = torch.randn(2, (nb + 1) * BS, 2, 32, generator=gen).to(DEV)
        q, k, v = (torch.randn(t_all, h, 32, generator=gen).to(DEV) for h in (4, 2, 2))

        def attend(c, md, rows):
            return paged_attention_triton(q[:rows], k[:rows], v[:rows], c, md, 0.3)
    eager_cache, graph_cache = cache.clone(), cache.clone()
    want = attend(eager_cache, eager_md, t_real)
    got = attend(graph_cache, graph_md, t_all)
    torch.testing.assert_close(got[:t_real], want, atol=2e-5, rtol=2e-5)
    assert torch.equal(graph_cache, eager_cache)  # padding requests wrote nothing
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("context_len", [0, 9])
def test_a_padded_prefill_chunk_matches_eager(context_len: int) -> None:
    """One row of n real tokens padded to q (a lone prefill chunk's graph): the real tokens'
    outputs and cache writes are the eager step's; the padding tokens write nothing."""
    gen = torch.Generator().manual_seed(5)
    backend = TritonAttentionBackend()
    n, q = 5, 16
    need = -(-(context_len + q) // BS)
    nb = need + 3
    table = torch.randperm(nb, generator=gen).tolist()[:need]
    real = [table[p // BS] * BS + p % BS for p in range(context_len, context_len + n)]
    buf = backend.alloc_graph_buffers(2, q, nb, DEV, block_size=BS, sliding_window=None)
    backend.fill_graph_buffers(buf, 1, q, [context_len], [table], real + [-1] * (q - n))
    graph_md = backend.graph_metadata(buf, 1, q)
    eager_md = backend.build_metadata(query_lens=[n], context_lens=[context_len],
                                      block_tables=[table], block_size=BS, num_decodes=0,
                                      sliding_window=None, device=DEV, null_block=nb)
    cache = torch.randn(2, (nb + 1) * BS, 2, 32, generator=gen).to(DEV)
    qt, k, v = (torch.randn(q, h, 32, generator=gen).to(DEV) for h in (4, 2, 2))
    eager_cache, graph_cache = cache.clone(), cache.clone()
    want = paged_attention_triton(qt[:n], k[:n], v[:n], eager_cache, eager_md, 0.3)
    got = paged_attention_triton(qt, k, v, graph_cache, graph_md, 0.3)
    torch.testing.assert_close(got[:n], want, atol=2e-5, rtol=2e-5)
    assert torch.equal(graph_cache, eager_cache)
