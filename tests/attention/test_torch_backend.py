"""paged_attention over a paged KV cache vs a dense float64 causal attention per request,
with the decode rows on the SDPA reference and on the CPU kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import build_attention_metadata
from shoal.attention.ops import cpu_paged_decode
from shoal.attention.selector import get_attention_backend
from shoal.attention.torch_backend import paged_attention

CPU = torch.device("cpu")
ATOL = RTOL = 1e-5


@pytest.fixture(autouse=True, params=["sdpa", "cpu-kernel"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case runs with the decode rows on the SDPA reference and on the C++ kernel."""
    if request.param == "sdpa":
        monkeypatch.setattr(cpu_paged_decode, "available", lambda: False)
    elif not cpu_paged_decode.available():
        pytest.skip("the CPU decode kernel is not built (make install builds it)")


@dataclass
class Seq:
    ctx: int  # tokens already in the cache
    q: int  # new tokens this step

    @property
    def total(self) -> int:
        return self.ctx + self.q


def reference(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, ctx: int, scale: float,
              window: int | None) -> torch.Tensor:
    """q: [Lq, Hq, D] at positions ctx.. ; k_all, v_all: [L, Hk, D] for positions 0..L-1."""
    hq, hk = q.shape[1], k_all.shape[1]
    kv_head = torch.arange(hq) // (hq // hk)  # query head h reads kv head h // group
    k = k_all.double()[:, kv_head]  # [L, Hq, D]
    v = v_all.double()[:, kv_head]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = ctx + torch.arange(q.shape[0])
    k_pos = torch.arange(k_all.shape[0])
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def slots_of(table: list[int], positions: range, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in positions]


def random_tables(seqs: list[Seq], bs: int, gen: torch.Generator,
                  spare: int = 3) -> tuple[list[list[int]], int]:
    need = [-(-s.total // bs) for s in seqs]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    return tables, num_blocks


def run_case(seqs: list[Seq], num_decodes: int, hq: int, hk: int, d: int, bs: int,
             window: int | None = None, seed: int = 0, garbage: float = 1.0) -> None:
    """Writes each request's context keys straight into its slots, runs one step and compares
    every request's outputs with the dense reference; also checks the new keys were written."""
    assert all(s.q == 1 for s in seqs[:num_decodes])
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_tables(seqs, bs, gen)
    # Unwritten slots hold finite garbage (as a reused block would).
    cache = torch.randn(2, num_blocks * bs, hk, d, generator=gen) * garbage
    ks = [torch.randn(s.total, hk, d, generator=gen) for s in seqs]
    vs = [torch.randn(s.total, hk, d, generator=gen) for s in seqs]
    qs = [torch.randn(s.q, hq, d, generator=gen) for s in seqs]
    for s, t, k, v in zip(seqs, tables, ks, vs):
        idx = torch.tensor(slots_of(t, range(s.ctx), bs), dtype=torch.long)
        cache[0, idx] = k[:s.ctx]
        cache[1, idx] = v[:s.ctx]
    md = build_attention_metadata(
        query_lens=[s.q for s in seqs], context_lens=[s.ctx for s in seqs], block_tables=tables,
        block_size=bs, num_decodes=num_decodes, sliding_window=window, device=CPU, null_block=0)
    scale = 1.0 / math.sqrt(d)
    q = torch.cat(qs)
    k_new = torch.cat([k[s.ctx:] for s, k in zip(seqs, ks)])
    v_new = torch.cat([v[s.ctx:] for s, v in zip(seqs, vs)])
    out = paged_attention(q, k_new, v_new, cache, md, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    start = 0
    for i, (s, t) in enumerate(zip(seqs, tables)):
        ref = reference(qs[i], ks[i], vs[i], s.ctx, scale, window)
        got = out[start:start + s.q]
        torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, i=i: f"request {i}: {m}")
        idx = torch.tensor(slots_of(t, range(s.ctx, s.total), bs), dtype=torch.long)
        assert torch.equal(cache[0, idx], ks[i][s.ctx:])
        assert torch.equal(cache[1, idx], vs[i][s.ctx:])
        start += s.q


HEADS = [pytest.param(8, 2, id="gqa8-2"), pytest.param(4, 4, id="mha4")]
DIMS = [64, 32]
BLOCKS = [4, 16]


@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("bs", BLOCKS)
def test_decodes_only(hq: int, hk: int, d: int, bs: int) -> None:
    # Lengths cover: one-token sequence, exactly one block, exactly on a block boundary after
    # several blocks, one past a boundary, and a long one.
    seqs = [Seq(5, 1), Seq(0, 1), Seq(bs - 1, 1), Seq(2 * bs - 1, 1), Seq(2 * bs, 1),
            Seq(3 * bs + 2, 1)]
    run_case(seqs, len(seqs), hq, hk, d, bs)


@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("bs", BLOCKS)
def test_prefills_only(hq: int, hk: int, d: int, bs: int) -> None:
    seqs = [Seq(0, 7), Seq(0, 2 * bs), Seq(0, 1), Seq(0, bs + 3)]
    run_case(seqs, 0, hq, hk, d, bs, seed=1)


@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("bs", BLOCKS)
def test_mixed_decodes_and_prefill_chunks_with_cached_context(hq: int, hk: int, d: int,
                                                              bs: int) -> None:
    seqs = [
        Seq(9, 1), Seq(0, 1), Seq(2 * bs - 1, 1),  # decodes
        Seq(bs + 3, 5),  # chunk after cached context, crossing a block
        Seq(0, 12),  # first chunk
        Seq(3, 2 * bs - 3),  # chunk ending exactly on a block boundary
        Seq(2 * bs, 1),  # one-token chunk after whole cached blocks
    ]
    run_case(seqs, 3, hq, hk, d, bs, seed=2)


@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(bs: int, window: int) -> None:
    seqs = [Seq(10, 1), Seq(2, 1), Seq(bs * 2 - 1, 1), Seq(6, 9), Seq(0, 11), Seq(20, 3)]
    run_case(seqs, 3, 8, 2, 32, bs, window=window, seed=3)


def test_single_token_sequence_alone() -> None:
    run_case([Seq(0, 1)], 1, 8, 2, 64, 16, seed=4)
    run_case([Seq(0, 1)], 0, 8, 2, 64, 16, seed=5)


def test_contiguous_and_reversed_block_tables_agree() -> None:
    # The block table, not the physical layout, decides what a request sees.
    gen = torch.Generator().manual_seed(6)
    bs, hk, d = 4, 2, 32
    seq = Seq(10, 3)
    k = torch.randn(seq.total, hk, d, generator=gen)
    v = torch.randn(seq.total, hk, d, generator=gen)
    q = torch.randn(seq.q, 4, d, generator=gen)
    outs = []
    for table in ([0, 1, 2, 3], [3, 2, 1, 0], [7, 0, 5, 2]):
        cache = torch.zeros(2, 8 * bs, hk, d)
        idx = torch.tensor(slots_of(table, range(seq.ctx), bs), dtype=torch.long)
        cache[0, idx], cache[1, idx] = k[:seq.ctx], v[:seq.ctx]
        md = build_attention_metadata(query_lens=[seq.q], context_lens=[seq.ctx],
                                      block_tables=[table], block_size=bs, num_decodes=0,
                                      sliding_window=None, device=CPU, null_block=0)
        outs.append(paged_attention(q, k[seq.ctx:], v[seq.ctx:], cache, md, 0.2))
    ref = reference(q, k, v, seq.ctx, 0.2, None)
    for o in outs:
        torch.testing.assert_close(o.double(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("window", [None, 6])
def test_sequential_steps_fill_the_cache(hq: int, hk: int, bs: int, window: int | None) -> None:
    """Three requests run step by step (chunked prefills, then decodes), the cache written only
    by paged_attention itself; every step matches the dense reference."""
    gen = torch.Generator().manual_seed(7)
    d = 32
    lengths = [23, 2 * bs, 9]
    # Chunk schedule per step: tokens per request (0 = not scheduled this step).
    plan = [[7, 5, 0], [9, 3, 4], [7, 2 * bs - 8, 5], [1, 1, 1], [1, 1, 1]]
    totals = [sum(p[i] for p in plan) for i in range(3)]
    ks = [torch.randn(n, hk, d, generator=gen) for n in totals]
    vs = [torch.randn(n, hk, d, generator=gen) for n in totals]
    qs = [torch.randn(n, hq, d, generator=gen) for n in totals]
    assert [sum(p[i] for p in plan[:3]) for i in range(3)] == lengths
    seqs = [Seq(0, n) for n in totals]
    tables, num_blocks = random_tables(seqs, bs, gen)
    cache = torch.zeros(2, num_blocks * bs, hk, d)
    done = [0, 0, 0]
    scale = 1.0 / math.sqrt(d)
    for step in plan:
        active = [i for i in range(3) if step[i]]
        decodes = [i for i in active if step[i] == 1 and done[i] >= lengths[i]]
        order = decodes + [i for i in active if i not in decodes]
        md = build_attention_metadata(
            query_lens=[step[i] for i in order], context_lens=[done[i] for i in order],
            block_tables=[tables[i] for i in order], block_size=bs, num_decodes=len(decodes),
            sliding_window=window, device=CPU, null_block=0)
        sl = {i: slice(done[i], done[i] + step[i]) for i in order}
        out = paged_attention(torch.cat([qs[i][sl[i]] for i in order]),
                              torch.cat([ks[i][sl[i]] for i in order]),
                              torch.cat([vs[i][sl[i]] for i in order]), cache, md, scale)
        start = 0
        for i in order:
            ref = reference(qs[i][sl[i]], ks[i][:done[i] + step[i]], vs[i][:done[i] + step[i]],
                            done[i], scale, window)
            torch.testing.assert_close(out[start:start + step[i]].double(), ref, atol=ATOL,
                                       rtol=RTOL)
            start += step[i]
            done[i] += step[i]
    assert done == totals


def test_metadata_slot_mapping_and_masks() -> None:
    md = build_attention_metadata(query_lens=[1, 3], context_lens=[5, 2],
                                  block_tables=[[3, 1], [2, 0]], block_size=4, num_decodes=1,
                                  sliding_window=None, device=CPU, null_block=0)
    # decode at position 5 -> block 1 (id 1), offset 1; prefill positions 2,3,4 of [2, 0]
    assert md.slot_mapping.tolist() == [1 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 0 * 4 + 0]
    assert md.num_tokens == 4 and md.num_decodes == 1 and md.num_prefills == 1
    # Contexts are read whole blocks at a time: 2 blocks of 4 keys, the last 2 masked.
    assert md.decode_mask is not None and md.decode_mask.shape == (1, 1, 1, 8)
    assert md.decode_mask[0, 0, 0].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert md.decode_block_tables is not None
    assert md.decode_block_tables.tolist() == [[3, 1]]
    assert md.prefill_block_tables is not None
    assert md.prefill_block_tables.tolist() == [[2, 0]]
    assert md.prefill_mask is not None
    assert md.prefill_mask[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    assert md.prefill_token_index is not None
    assert md.prefill_token_index.tolist() == [[1, 2, 3]]


def test_stale_values_in_unused_slots_do_not_leak() -> None:
    # Slots outside every request's context (the tail of a partly filled block, blocks of
    # earlier requests) hold stale values: masked keys get zero weight, so they must not
    # affect the outputs. Padding reads the null block, which is never written. (Blocks of a
    # request that produced NaN are zeroed by the model runner, see test_engine_scenarios.)
    gen = torch.Generator().manual_seed(8)
    bs, hq, hk, d = 4, 4, 2, 16
    seqs = [Seq(2, 1), Seq(9, 1), Seq(0, 3), Seq(4, 6)]
    tables = [[1], [2, 3, 4], [5], [6, 7, 8]]
    cache = torch.randn((2, 10 * bs, hk, d), generator=gen) * 1e4
    cache[:, 9 * bs:] = 0.0  # block 9 is the null block: never written, so still zero
    ks = [torch.randn(s.total, hk, d, generator=gen) for s in seqs]
    vs = [torch.randn(s.total, hk, d, generator=gen) for s in seqs]
    qs = [torch.randn(s.q, hq, d, generator=gen) for s in seqs]
    for s, t, k, v in zip(seqs, tables, ks, vs):
        idx = torch.tensor(slots_of(t, range(s.ctx), bs), dtype=torch.long)
        cache[0, idx], cache[1, idx] = k[:s.ctx], v[:s.ctx]
    md = build_attention_metadata(
        query_lens=[s.q for s in seqs], context_lens=[s.ctx for s in seqs], block_tables=tables,
        block_size=bs, num_decodes=2, sliding_window=None, device=CPU, null_block=9)
    out = paged_attention(torch.cat(qs), torch.cat([k[s.ctx:] for s, k in zip(seqs, ks)]),
                          torch.cat([v[s.ctx:] for s, v in zip(seqs, vs)]), cache, md, 0.25)
    start = 0
    for i, s in enumerate(seqs):
        ref = reference(qs[i], ks[i], vs[i], s.ctx, 0.25, None)
        torch.testing.assert_close(out[start:start + s.q].double(), ref, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, i=i: f"request {i}: {m}")
        start += s.q


def test_backend_says_what_it_cannot_do_and_the_hooks_raise() -> None:
    """The reference backend declares no fused rotary and no CUDA graphs; the runner reads the
    flags, and a hook called anyway fails loudly rather than doing something half-right."""
    backend = get_attention_backend(CPU)
    assert isinstance(backend, AttentionBackend) and backend.name == "torch"
    assert not (backend.fuses_rope_and_cache_write or backend.supports_cuda_graphs)
    with pytest.raises(NotImplementedError, match="torch attention backend"):
        backend.alloc_graph_buffers(4, 4, 8, CPU, block_size=16, sliding_window=None)
    with pytest.raises(NotImplementedError):
        backend.graph_metadata(None, 1, 16)
    with pytest.raises(ValueError, match="'torch' or 'triton'"):
        get_attention_backend(CPU, "flash")
