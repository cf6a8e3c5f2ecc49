"""The lightning indexer's scores over FP8 keys on tensor cores (shoal/attention/ops/
v4_index_scores.py; kv_cache_dtype="fp8": block-scaled e4m3 rows, shoal/attention/fp8_rows.py),
in Triton's interpreter on the CPU (compiled on a GPU), against a plain float64 reference of
the keys read back:
- bf16 / fp16 queries over keys of one scale (V3.2's indexer keys at ratio 1; V4's indexer
  segment after its entry's key, at ratio 4) and of several (a tensor-core dot per block), and
  the float32 path where blocks are too small for a dot or the queries are float32;
- rows on page edges, a row with fewer entries than its table, a graph's padding row
  (position -1, table zeros), rows sharing a table row (table_rows);
- the tensor-core scores against the float32 path's, and the picks in fixed pieces (the
  shapes a CUDA graph captures), bit for bit the same on a second run;
- V4's CSA indexer handing FP8 entries its bf16 model's queries in bf16 (a float32 model's
  in float32).

No test wants bits of the float32 path: the tensor-core dot sums exact products in its own
order and applies each block's scale to the float32 sum (one rounding), where the float32
path rounds k8 * scale, then each product. Both are float32 sums of the same exact terms, so
each score lies within (terms + heads + a few) roundings of sum_h |w_h| sum_d |q_hd k_d| *
scale of the exact score (the bound _reference gives; one rounding taken as 2^-23, twice
float32's unit roundoff: a tensor core's float32 adds may truncate rather than round)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.fp8_rows import BlockScaledRows  # noqa: E402
from shoal.attention.ops.v4_index_scores import (  # noqa: E402
    tensor_core_columns,
    v4_index_scores,
)
from shoal.attention.ops.v4_paged_keys import PagedKeys, key_operands  # noqa: E402
from shoal.layers.score_pieces import fixed_pieces, top_k_in_pieces  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROUNDING = 2.0 ** -23


@dataclass(frozen=True)
class Layout:
    """One case's FP8 rows: the row's segments, the index key's column, width and ratio."""

    parts: tuple[tuple[int, int], ...]
    column: int
    dim: int
    ratio: int


V32 = Layout(((32, 128),), 0, 32, 1)  # V3.2's key alone, one scale (gcd(32, 128))
V4_SEGMENT = Layout(((32, 8), (32, 128)), 32, 32, 4)  # V4's entry: its key, then the indexer's
SEVERAL = Layout(((32, 8), (64, 16)), 32, 64, 4)  # an index key of four scale blocks
BLOCKS_OF_8 = Layout(((32, 8),), 0, 32, 1)  # blocks under a dot's depth: the float32 path


@dataclass
class Case:
    q: torch.Tensor  # [R, H, D] in the queries' dtype
    weights: torch.Tensor  # [R, H] float32
    positions: torch.Tensor  # [R]
    keys: PagedKeys  # FP8 pages [blocks, slots, row_bytes] and tables [R, N]
    layout: Layout
    block_size: int
    scale: float


def _case(layout: Layout, dtype: torch.dtype, gen: torch.Generator, heads: int = 20,
          block_size: int = 8) -> Case:
    """Rows at positions on and off page edges (7 and 8: the last token of a page and the
    first of the next), one seeing fewer entries than its table holds, a padding row (-1,
    table zeros); keys of sizes 2^-4 .. 2^4 (each row its own), over shuffled pages."""
    fmt = BlockScaledRows.of(*layout.parts)
    slots = -(-block_size // layout.ratio)
    num_blocks, width = 32, 6
    sizes = (torch.rand(num_blocks, slots, 1, generator=gen) * 8 - 4).exp2()
    values = torch.randn(num_blocks, slots, fmt.width, generator=gen) * sizes
    pages = fmt.quantize(values)
    positions = [47, 7, 8, 30, -1]
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = perm[:width * 4].view(4, width)
    tables = torch.cat([tables, torch.zeros(1, width, dtype=torch.long)]).to(torch.int32)
    q = torch.randn(len(positions), heads, layout.dim, generator=gen).to(dtype)
    weights = torch.randn(len(positions), heads, generator=gen)
    return Case(q.to(DEV), weights.to(DEV), torch.tensor(positions, device=DEV),
                PagedKeys(pages.to(DEV), tables.to(DEV), fmt), layout, block_size,
                layout.dim ** -0.5)


def _reference(case: Case, table_rows: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's exact scores [R, E] float64, -inf past its own entries; the bound of a
    float32 computation's error on each): the keys read back (fp8_rows' dequantize), entry w
    in the page of its last token's block, as v4_index_scores.py addresses it."""
    lay, bs = case.layout, case.block_size
    keys = case.keys.fp8.dequantize(case.keys.pages.cpu(), torch.float64,
                                    slice(lay.column, lay.column + lay.dim))
    tables = case.keys.tables.cpu().long()
    n = tables.shape[1] * bs // lay.ratio
    w = torch.arange(n)
    col = ((w + 1) * lay.ratio - 1) // bs
    slot = w - col * bs // lay.ratio
    exact = torch.empty(case.q.shape[0], n, dtype=torch.float64)
    bound = torch.empty_like(exact)
    for r in range(case.q.shape[0]):
        t = r if table_rows is None else int(table_rows[r])
        k = keys[tables[t, col], slot]  # [E, D]
        q, wt = case.q[r].cpu().double(), case.weights[r].cpu().double()
        exact[r] = (wt[:, None] * (q @ k.T).relu()).sum(0) * case.scale
        size = (wt.abs()[:, None] * (q.abs() @ k.abs().T)).sum(0) * case.scale
        bound[r] = (lay.dim + q.shape[0] + 6) * ROUNDING * size
        seen = min(max((int(case.positions[r]) + 1) // lay.ratio, 0), n)
        exact[r, seen:] = float("-inf")
    return exact, bound


def _assert_within(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    out = out.cpu().double()
    assert torch.equal(out.isinf(), exact.isinf()) and not out.isnan().any()
    finite = exact.isfinite()
    err = (out - exact).abs()[finite]
    assert (err <= bound[finite]).all(), (
        f"{int((err > bound[finite]).sum())} scores past the bound, worst "
        f"{(err / bound[finite]).max().item():.2f}x it")


def _scores(case: Case, q: torch.Tensor | None = None,
            table_rows: torch.Tensor | None = None) -> torch.Tensor:
    return v4_index_scores(case.q if q is None else q, case.weights, case.positions, case.keys,
                           case.layout.column, case.layout.ratio, case.block_size, case.scale,
                           table_rows=table_rows)


@pytest.mark.parametrize("layout, dtype, columns", [
    (V32, torch.bfloat16, 32), (V4_SEGMENT, torch.bfloat16, 32), (SEVERAL, torch.bfloat16, 16),
    (V4_SEGMENT, torch.float16, 32), (BLOCKS_OF_8, torch.bfloat16, None),
    (V32, torch.float32, None)],
    ids=["v32-one-scale", "v4-segment", "four-scales", "fp16", "blocks-of-8-float32-path",
         "float32-queries"])
def test_scores_over_fp8_keys_match_the_exact_scores(layout: Layout, dtype: torch.dtype,
                                                     columns: int | None):
    """columns: each tensor-core dot's depth (the key's width, or a scale block's), None
    where the float32 path scores (what tensor_core_columns picks for the case)."""
    case = _case(layout, dtype, torch.Generator().manual_seed(0))
    operands = key_operands("entries", case.keys, layout.column, layout.dim, dtype)
    assert tensor_core_columns(dtype, operands, layout.dim) == columns
    exact, bound = _reference(case)
    out = _scores(case)
    assert out.shape == exact.shape == (5, 6 * case.block_size // layout.ratio)
    seen = (case.positions.cpu() + 1).div(layout.ratio, rounding_mode="floor")
    assert out.isfinite().sum(-1).tolist() == seen.clamp(0, out.shape[1]).tolist()
    _assert_within(out, exact, bound)


@pytest.mark.parametrize("layout", [V32, SEVERAL], ids=["one-scale", "four-scales"])
def test_tensor_cores_and_the_float32_path_agree_within_their_sums_error(layout: Layout):
    """The same bf16 queries widened to float32 take the float32 path (the old one): the two
    differ by no more than both bounds (not bit for bit: see the module's note); rows sharing
    table rows (a prefill chunk's tokens) read them through table_rows."""
    case = _case(layout, torch.bfloat16, torch.Generator().manual_seed(1))
    table_rows = torch.tensor([0, 0, 2, 2, 4], dtype=torch.int32, device=DEV)
    exact, bound = _reference(case, table_rows)
    cores = _scores(case, table_rows=table_rows)
    plain = _scores(case, case.q.float(), table_rows)
    _assert_within(cores, exact, bound)
    _assert_within(plain, exact, bound)
    _assert_within(cores, plain.cpu().double(), 2 * bound)


@pytest.mark.parametrize("layout", [V32, V4_SEGMENT], ids=["v32", "v4-segment"])
def test_picks_in_fixed_pieces_carry_the_top_scores_and_repeat(layout: Layout):
    """top_k_in_pieces over fixed pieces (the shapes a captured graph launches: the tables'
    whole width, the padding row, a budget of two rows a piece): each row's picks hold its
    exact top-k scores up to ties within the bound, and a second run gives the same picks."""
    case = _case(layout, torch.bfloat16, torch.Generator().manual_seed(2))
    lay, topk, columns = case.layout, 4, case.keys.tables.shape[1]
    entries = columns * case.block_size // lay.ratio
    pieces = fixed_pieces(case.q.shape[0], columns, case.block_size, lay.ratio, topk,
                          2 * (entries + 3 * topk))
    assert [(p.start, p.stop) for p in pieces] == [(0, 2), (2, 4), (4, 5)]

    def picks() -> torch.Tensor:
        return top_k_in_pieces(pieces, case.q, case.weights, case.positions, case.keys, None,
                               lay.column, lay.ratio, case.block_size, case.scale, topk)
    got = picks()
    assert torch.equal(got, picks())
    exact, bound = _reference(case)
    mine = exact.gather(1, got.cpu().long()).sort(-1, descending=True).values
    best = exact.topk(topk, dim=-1).values
    assert torch.equal(mine.isinf(), best.isinf())
    finite = best.isfinite()
    tie = 2 * bound.amax(-1, keepdim=True).expand_as(best)
    assert ((mine - best).abs()[finite] <= tie[finite]).all()
    seen = (case.positions.cpu() + 1).div(lay.ratio, rounding_mode="floor").clamp(0, topk)
    assert mine.isfinite().sum(-1).tolist() == seen.tolist()  # (short rows, the padding row)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_v4_indexer_scores_fp8_entries_with_its_half_queries(dtype: torch.dtype,
                                                               monkeypatch):
    """DeepSeek-V4's CSA indexer (CompressedIndexer.pick_rows) over FP8 entries: a bf16
    model's queries (bf16 values, widened) reach the kernel narrowed back to bf16, so its
    index keys (one scale each: blocks of gcd(32, 128)) take the tensor cores; a float32
    model's stay float32. Either way each row's picks hold its top-k torch scores (the
    layer's float32 scores of the entries read back) up to ties within twice the bound."""
    from layers.test_v4_decode_attention_triton import BS, POSITIONS, WIDTH, _cfg, _inputs, _step
    from layers.test_v4_fp8_decode_kernels import _fp8_layer

    import shoal.attention.ops.v4_index_scores as index_ops
    from shoal.layers.compressed_attention import CSA

    gen = torch.Generator(DEV.type).manual_seed(5)
    layer = _fp8_layer(_cfg(CSA), dtype, DEV.type, 64 * BS, gen)
    ix, d = layer.indexer, layer.head_dim
    assert layer.entries.fp8_rows.segments[-1] == (ix.head_dim, ix.head_dim)
    ctx = _inputs(layer, len(POSITIONS), dtype, DEV.type, gen)
    step = _step(list(POSITIONS), WIDTH, 64, 1, DEV.type, gen)
    handed, kernel = [], index_ops.v4_index_scores

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        handed.append(q.dtype)
        return kernel(q, *args, **kwargs)
    monkeypatch.setattr(index_ops, "v4_index_scores", spy)
    picks = ix.pick_rows(ctx.index_q, ctx.index_w, step.decode_positions,
                         PagedKeys(*layer.entries.decode_pages(step)), d, BS)
    assert handed == [dtype] and picks.shape == (len(POSITIONS), ix.topk)
    keys, own = layer.entries.load_decodes(step, slice(None), slice(d, None), torch.float32)
    ref = ix.scores(ctx.index_q, ctx.index_w, keys, own).double().cpu()
    size = (ctx.index_w.abs()[:, :, None] * (ctx.index_q.abs() @ keys.abs().transpose(-1, -2))
            ).sum(1).double().cpu() * ix.scale
    tie = 2 * (ix.head_dim + ix.n_heads + 6) * ROUNDING * size.amax(-1, keepdim=True)
    mine = ref.gather(1, picks.cpu().long()).sort(-1, descending=True).values
    best = ref.topk(ix.topk, dim=-1).values
    assert torch.equal(mine.isinf(), best.isinf()) and best[-1].isinf().all()
    finite = best.isfinite()
    assert ((mine - best).abs()[finite] <= tie.expand_as(best)[finite]).all()
