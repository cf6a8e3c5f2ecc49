"""DeepSeek-V3.2's sparse latent attention on the Triton backend (shoal/attention/ops/
mla_sparse.py, the indexer's picks of shoal/layers/sparse_picks.py), in Triton's interpreter
on the CPU (compiled on a GPU):
- the kernel against a float64 softmax over each row's picks: rows shorter than top-k,
  picks of -1 and past the row masked, a padding row, positions on page boundaries, one and
  several splits, strided q, an FP8 cache as the MLA cache write stores it;
- the indexer + forward_mla on both backends' metadata of one mixed step (decodes short and
  long, a fresh prompt, chunks after cached context) and on decode graph metadata with a
  padding row: the Triton path gives the torch sparse path's outputs and caches, FP8 caches
  (the latent rows, the indexer's block-scaled keys) byte for byte;
- a tiny V3.2 through the engine on the Triton backend: transformers' tokens; with
  kv_cache_dtype='fp8', the torch backend's FP8 run.
The GPU tests run V3.2's shapes in bf16 (128 heads, Dk 576, top-2048), replay a CUDA graph
and print the kernel's times at several tilings beside dense MLA decode's, and the indexer's
picks and scores (FP8 keys on tensor cores against the float32 path); the tiny V3.2 runs in
CUDA graphs, with an FP8 cache too."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from deepseek_tiny import V3, check_against_hf, write_deepseek  # noqa: E402
from gpu_timing import time_ms  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.attention.ops import mla_sparse  # noqa: E402
from shoal.attention.ops.mla_sparse import SparseRows, mla_sparse_attention  # noqa: E402
from shoal.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from shoal.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shoal.layers.sparse_indexer import LightningIndexer  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V_DIM, ROPE, BS, TOPK = 32, 16, 4, 8
TOL = {"atol": 2e-5, "rtol": 2e-5}
FP8_SCALE = 0.25  # an FP8 latent cache's scale (the checkpoint's k_scale of the layer)


def _reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, rows: SparseRows,
               block_size: int, scale: float, v_dim: int) -> torch.Tensor:
    """Per row: softmax over the latent rows of its valid picks (>= 0, < seen, among its
    first min(K, seen)), in float64; zeros where it reads none."""
    r, h, _ = q.shape
    out = torch.zeros(r, h, v_dim, dtype=torch.float64)
    for i in range(r):
        seen = int(rows.seen[i])
        pos = rows.picks[i, :max(min(rows.picks.shape[1], seen), 0)].long().cpu()
        pos = pos[(pos >= 0) & (pos < seen)]
        if not len(pos):
            continue
        table = tables[int(rows.table_rows[i])].long().cpu()
        lat = cache.cpu().double()[table[pos // block_size] * block_size + pos % block_size]
        p = torch.softmax(q[i].cpu().double() @ lat.T * scale, -1)
        out[i] = p @ lat[:, :v_dim]
    return out


def _kernel_case(gen: torch.Generator, dtype: torch.dtype = torch.float32, heads: int = 20,
                 strided_q: bool = False):
    """Two requests (tables over shuffled blocks of 16), rows of each: a long row with more
    visible keys than K, a short one (seen < K: its tail picks are garbage past it), one
    with -1 and past-seen picks among its first, positions on page edges, a padding row."""
    bs, k, dk = 16, 12, V_DIM + ROPE
    lens = [70, 40]
    nb = 12
    perm = torch.randperm(nb, generator=gen)
    tables = torch.stack([perm[:5], perm[5:10]]).to(torch.int32)
    cache = torch.randn(nb * bs, dk, generator=gen)
    seen = [70, 40, 5, 33, 0, 64]
    table_rows = [0, 1, 0, 1, 1, 0]
    picks = []
    for s, t in zip(seen, table_rows):
        perm_pos = torch.randperm(max(lens[t], 1), generator=gen)
        own = perm_pos[perm_pos < s][:k].tolist() if s else []
        picks.append(own + [lens[t] + 3] * (k - len(own)))  # (garbage past the row)
    picks[0][:4] = [15, 16, 31, 32]  # page edges
    picks[3][2], picks[3][5] = -1, 50  # masked among its first min(K, seen)
    if strided_q:
        q = torch.randn(6, heads, 2 * dk + 8, generator=gen)[:, :, 8:8 + dk]
    else:
        q = torch.randn(6, heads, dk, generator=gen)
    rows = SparseRows(torch.tensor(picks, dtype=torch.int32, device=DEV),
                      torch.tensor(seen, dtype=torch.int32, device=DEV),
                      torch.tensor(table_rows, dtype=torch.int64, device=DEV))
    return q.to(DEV, dtype), cache.to(DEV, dtype), tables.to(DEV), rows, bs


# 20 heads: a second, partial head block
@pytest.mark.parametrize("num_splits, strided, heads", [(1, False, 20), (2, True, 3),
                                                        (4, False, 3)])
def test_kernel_reads_only_each_rows_picks(num_splits: int, strided: bool, heads: int):
    gen = torch.Generator().manual_seed(num_splits)
    q, cache, tables, rows, bs = _kernel_case(gen, heads=heads, strided_q=strided)
    scale = 1 / math.sqrt(q.shape[2])
    out = mla_sparse_attention(q, cache, tables, rows, bs, scale, V_DIM, num_splits=num_splits)
    want = _reference(q, cache, tables, rows, bs, scale, V_DIM)
    torch.testing.assert_close(out.cpu().double(), want, **TOL)
    assert torch.count_nonzero(out[4]) == 0  # the padding row (seen 0)


def test_rows_past_the_grid_limit_launch_in_pieces(monkeypatch):
    """More rows than a launch's grid axis holds (65,535 on CUDA; 2 here) run in pieces,
    each row still with its own picks, count and table row."""
    monkeypatch.setattr(mla_sparse, "MAX_GRID_ROWS", 2)
    gen = torch.Generator().manual_seed(5)
    q, cache, tables, rows, bs = _kernel_case(gen, heads=3)
    scale = 1 / math.sqrt(q.shape[2])
    out = mla_sparse_attention(q, cache, tables, rows, bs, scale, V_DIM, num_splits=2)
    want = _reference(q, cache, tables, rows, bs, scale, V_DIM)
    torch.testing.assert_close(out.cpu().double(), want, **TOL)


def test_fp8_cache_is_read_scaled():
    """The FP8 latent rows as the Triton MLA path writes them (write_mla_cache: the same bytes
    as the torch backend's kv_quant.quantize, on every device), read back times the layer's
    scale. Past the pages the tables use, rows of values at e4m3's edges (tests/
    e4m3_edge_values.py: negative values that round to -0, which an H100's float cast wrote
    as +0, subnormals, ties, saturation) are written too, byte for byte."""
    from e4m3_edge_values import e4m3_edge_values

    from shoal.attention import kv_quant
    from shoal.attention.ops.mla_cache_write import write_mla_cache

    gen = torch.Generator().manual_seed(9)
    q, cache, tables, rows, bs = _kernel_case(gen, heads=3)
    kv_scale = 0.5
    edges = e4m3_edge_values().to(DEV) * kv_scale
    dk = cache.shape[1]
    edges = torch.cat([edges, edges.new_zeros(-edges.numel() % (bs * dk))]).view(-1, dk)
    latent = torch.cat([cache, edges])
    stored = torch.zeros(latent.shape, dtype=kv_quant.FP8_KV_DTYPE, device=DEV)
    write_mla_cache(latent, stored, torch.arange(len(latent), device=DEV), kv_scale)
    assert torch.equal(stored.view(torch.uint8), kv_quant.quantize(latent, kv_scale)
                       .view(torch.uint8))
    stored = stored[:len(cache)]
    out = mla_sparse_attention(q, stored, tables, rows, bs, 0.2, V_DIM, kv_scale=kv_scale,
                               num_splits=2)
    want = _reference(q, kv_quant.dequantize(stored, kv_scale, torch.float32), tables, rows, bs,
                      0.2, V_DIM)
    torch.testing.assert_close(out.cpu().double(), want, **TOL)


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(1)
    q, cache, tables, rows, bs = _kernel_case(gen, heads=3)
    with pytest.raises(ValueError, match="picks must be"):
        mla_sparse_attention(q, cache, tables, SparseRows(rows.picks[:2], rows.seen,
                                                          rows.table_rows), bs, 1.0, V_DIM)
    with pytest.raises(ValueError, match="table_rows must be"):
        mla_sparse_attention(q, cache, tables, SparseRows(rows.picks, rows.seen,
                                                          rows.table_rows.float()), bs, 1.0,
                             V_DIM)
    with pytest.raises(ValueError, match="seen must be"):
        mla_sparse_attention(q, cache, tables, SparseRows(rows.picks, rows.seen.long(),
                                                          rows.table_rows), bs, 1.0, V_DIM)
    with pytest.raises(ValueError, match="block_h 24"):
        mla_sparse.launch(q, cache, tables, rows, bs, 1.0, V_DIM, block_h=24)


# ---- the indexer and forward_mla on both backends' metadata --------------------------------

def _indexer(seed: int) -> LightningIndexer:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v32", **dict(V3, index_n_heads=16, index_head_dim=32,
                                                      index_topk=TOPK))
    torch.manual_seed(seed)
    ix = LightningIndexer(cfg, torch.float32, use_triton_ops=False)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return ix.to(DEV)


def _layer_step(query_lens: list[int], context_lens: list[int], heads: int, seed: int):
    """Block tables over shuffled blocks, random caches of both kinds (the step's own rows
    are written by it), the step's inputs."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    nb = 48
    free = list(range(nb))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(q + c) // BS))]
              for q, c in zip(query_lens, context_lens)]
    t = sum(query_lens)
    caches = (torch.randn(1, (nb + 1) * BS, 1, V_DIM + ROPE, generator=gen),
              torch.randn(1, (nb + 1) * BS, 1, 32, generator=gen))
    for c in caches:
        c[:, nb * BS:] = 0  # the null block
    inputs = dict(q=torch.randn(t, heads, V_DIM + ROPE, generator=gen),
                  latent=torch.randn(t, V_DIM + ROPE, generator=gen),
                  hidden=torch.randn(t, 64, generator=gen),
                  q_resid=torch.randn(t, 32, generator=gen),
                  positions=torch.tensor([c + i for q, c in zip(query_lens, context_lens)
                                          for i in range(q)]))
    return tables, caches, inputs, nb


def _as_fp8(caches, ix: LightningIndexer):
    """The random caches as an FP8 pool holds them: latent rows with one scale (FP8_SCALE),
    the indexer's keys as block-scaled rows (its fp8_keys layout), both as float8 bytes."""
    from shoal.attention import kv_quant

    latent, keys = caches
    stored = ix.fp8_keys.quantize(keys).view(kv_quant.FP8_KV_DTYPE)
    return kv_quant.quantize(latent, FP8_SCALE), stored


def _sparse_mla(backend, ix: LightningIndexer, md, caches, inputs, scale: float):
    """The layer's work: the indexer's selection, then forward_mla with it (an FP8 latent
    cache: its scale FP8_SCALE)."""
    from shoal.attention import kv_quant

    latent_cache, ix.kv_cache = (c.clone().to(DEV) for c in caches)
    x = {k: v.to(DEV) for k, v in inputs.items()}
    select = ix(x["hidden"], x["q_resid"], x["positions"], md)
    kw = {"kv_scale": FP8_SCALE} if kv_quant.is_fp8(latent_cache) else {}
    out = backend.forward_mla(x["q"], x["latent"], latent_cache, md, scale, V_DIM, select, **kw)
    return out.cpu(), latent_cache.cpu(), ix.kv_cache.cpu(), select


def _same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal caches; FP8 ones byte for byte (the two backends store the same rows)."""
    if got.dtype == torch.float8_e4m3fn:
        assert want.dtype == got.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fp8", [False, True], ids=["auto", "fp8"])
def test_mixed_step_matches_the_torch_sparse_path(fp8: bool):
    """Decodes at 4 (within top-k), 21 and 14 keys, a fresh prompt of 12 tokens, chunks of 9
    after 4 cached and of 7 after 11, pages of 4. FP8 caches (kv_cache_dtype="fp8"): the
    Triton path writes the latent rows and the indexer's block-scaled keys byte for byte as
    the torch path does, and reads both back alike."""
    query_lens, context_lens, nd = [1, 1, 1, 12, 9, 7], [3, 20, 13, 0, 4, 11], 3
    tables, caches, inputs, nb = _layer_step(query_lens, context_lens, 3, seed=3)
    ix, scale = _indexer(0), (V_DIM + ROPE) ** -0.5
    if fp8:
        caches = _as_fp8(caches, ix)
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        md = backend.build_metadata(query_lens=query_lens, context_lens=context_lens,
                                    block_tables=tables, block_size=BS, num_decodes=nd,
                                    sliding_window=None, device=DEV, null_block=nb)
        outs.append(_sparse_mla(backend, ix, md, caches, inputs, scale))
    (ref, ref_lat, ref_keys, ref_select), (out, lat, keys, rows) = outs
    assert isinstance(rows, SparseRows) and rows.picks.shape == (sum(query_lens), TOPK)
    # each row's count: its position + 1
    assert rows.seen.tolist() == (inputs["positions"] + 1).tolist()
    assert rows.table_rows.tolist() == [r for r, n in enumerate(query_lens) for _ in range(n)]
    # the long decodes' picks: the torch path's selection (FP8: scored on the dequantized keys)
    for i in (1, 2):
        seen = int(rows.seen[i])
        mine = set(rows.picks[i, :min(TOPK, seen)].tolist())
        assert mine == set(ref_select.decode[i, 0, 0].nonzero().flatten().tolist())
    _same_cache(lat, ref_lat)
    _same_cache(keys, ref_keys)
    if fp8:  # the step's rows were written (not the random ones left)
        assert not torch.equal(keys.view(torch.uint8), caches[1].view(torch.uint8))
    torch.testing.assert_close(out, ref, **TOL)


def test_short_steps_skip_the_indexer():
    """No row sees more than top-k keys: no selection, dense MLA."""
    tables, caches, inputs, nb = _layer_step([1, 5], [6, 2], 4, seed=4)
    backend = TritonAttentionBackend()
    md = backend.build_metadata(query_lens=[1, 5], context_lens=[6, 2], block_tables=tables,
                                block_size=BS, num_decodes=1, sliding_window=None, device=DEV,
                                null_block=nb)
    assert _sparse_mla(backend, _indexer(1), md, caches, inputs, 0.2)[3] is None


def test_eager_picks_score_each_piece_over_its_rows_reach(monkeypatch):
    """Two short decodes and a fresh prompt of 6 beside a chunk of 9 after 30 cached tokens
    (tables of 10 blocks of 4, top-8): eager metadata (its host_lens) scores the short rows
    over the 2 blocks they reach (top-8's least) and the chunk over all 10; with a budget
    of 4 rows x (40 + 3 x 8), graph-like metadata (no host_lens) in pieces of 4 rows over
    every block. Every row's visible picks are the ones of one piece over the whole tables;
    int32 on every path."""
    import dataclasses

    import shoal.attention.ops.v4_index_scores as index_ops
    import shoal.layers.sparse_picks as sp

    query_lens, context_lens = [1, 1, 6, 9], [3, 5, 0, 30]
    gen = torch.Generator().manual_seed(5)
    tables = [torch.randperm(24, generator=gen)[:-(-(q + c) // BS)].tolist()
              for q, c in zip(query_lens, context_lens)]
    md = TritonAttentionBackend().build_metadata(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables, block_size=BS,
        num_decodes=2, sliding_window=None, device=DEV, null_block=0)
    t = sum(query_lens)
    pages = torch.randn(24, BS, 16, generator=gen).to(DEV)
    q = torch.randn(t, 4, 16, generator=gen).to(DEV)
    w = torch.randn(t, 4, generator=gen).to(DEV)
    scores, launches = index_ops.v4_index_scores, []

    def counted(q, *args, **kwargs):
        out = scores(q, *args, **kwargs)
        launches.append(tuple(out.shape))
        return out
    monkeypatch.setattr(index_ops, "v4_index_scores", counted)  # (score_pieces' call)
    graph_like = dataclasses.replace(md, host_lens=None)
    runs = {}
    for name, m, budget in (("whole", graph_like, 1 << 26), ("fixed", graph_like, 4 * 64),
                            ("cut", md, 1 << 26), ("cut-budget", md, 4 * 64)):
        monkeypatch.setattr(sp, "SCORE_ELEMENTS", budget)
        launches.clear()
        runs[name] = sp.pick_rows(q, w, m, pages, TOPK, 0.25), list(launches)
    assert runs["whole"][1] == [(t, 40)]
    assert runs["fixed"][1] == [(4, 40)] * 4 + [(1, 40)]
    assert runs["cut"][1] == [(8, 8), (9, 40)]
    # 4 x (40 + 24) holds 8 rows over 8 positions, 4 over 36 or 40 (the chunk's first rows
    # reach 9 blocks, the others 10)
    assert runs["cut-budget"][1] == [(8, 8), (4, 36), (4, 40), (1, 40)]
    whole = runs["whole"][0]
    assert whole.seen.tolist() == [4, 6, 1, 2, 3, 4, 5, 6] + list(range(31, 40))
    for name, (rows, _) in runs.items():
        assert rows.picks.dtype == torch.int32 and rows.picks.shape == (t, TOPK), name
        assert torch.equal(rows.seen, whole.seen)
        for i, seen in enumerate(whole.seen.tolist()):
            n = min(TOPK, seen)
            assert torch.equal(rows.picks[i, :n], whole.picks[i, :n]), (name, i)


@pytest.mark.parametrize("fp8", [False, True], ids=["auto", "fp8"])
@pytest.mark.parametrize("q_len", [1, 3], ids=["decodes", "verify-chunks"])
def test_graph_metadata_with_a_padding_row(q_len: int, fp8: bool):
    """The metadata a graph replays (tables 10 blocks wide: past top-k, so the shape
    selects), 3 requests padded to 4 rows of q_len tokens: the padding row writes nothing
    (a decode's gives zeros; a chunk's reads stale tables, its outputs unread), the real
    rows give the torch path's (decodes, or chunks after cached context); FP8 caches: the
    same bytes, the padding row's block-scaled key written nowhere either."""
    context_lens = [17, 2, 30]
    query_lens = [q_len] * 3
    tables, caches, inputs, nb = _layer_step(query_lens, context_lens, 3, seed=5)
    ix, scale = _indexer(2), 0.2
    if fp8:
        caches = _as_fp8(caches, ix)
    backend = TritonAttentionBackend()
    buf = backend.alloc_graph_buffers(8, 16, 10, DEV, block_size=BS, sliding_window=None)
    slots = [t[p // BS] * BS + p % BS for t, c in zip(tables, context_lens)
             for p in range(c, c + q_len)]
    backend.fill_graph_buffers(buf, 4, q_len, context_lens, tables, slots)
    md = backend.graph_metadata(buf, 4, q_len)
    padded = {k: torch.cat([v, v[:q_len]]) for k, v in inputs.items()}
    out, lat, keys, rows = _sparse_mla(backend, ix, md, caches, padded, scale)
    want_seen = [c + i + 1 for c in context_lens + [0] for i in range(q_len)]
    assert isinstance(rows, SparseRows) and rows.seen.tolist() == (
        want_seen if q_len > 1 else [18, 3, 31, 0])
    torch_backend = TorchAttentionBackend()
    rmd = torch_backend.build_metadata(query_lens=query_lens, context_lens=context_lens,
                                       block_tables=tables, block_size=BS,
                                       num_decodes=3 if q_len == 1 else 0,
                                       sliding_window=None, device=DEV, null_block=nb)
    ref, ref_lat, ref_keys, _ = _sparse_mla(torch_backend, ix, rmd, caches, inputs, scale)
    torch.testing.assert_close(out[:3 * q_len], ref, **TOL)
    if q_len == 1:
        assert torch.count_nonzero(out[3]) == 0
    _same_cache(lat, ref_lat)  # the padding row wrote nothing
    _same_cache(keys, ref_keys)


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory):
    """A tiny random V3.2 checkpoint (top-8) and its transformers model."""
    return write_deepseek(tmp_path_factory.mktemp("v32"), "deepseek_v32", 3,
                          **dict(V3, index_n_heads=8, index_head_dim=32, index_topk=TOPK))


def test_tiny_v32_engine_on_the_triton_backend(tiny_v32):
    """Transformers' greedy tokens and logprobs (1e-4) past index_topk 8, the prompts in
    chunks beside decodes; CUDA places V3.2 past top-k on this path (no refusal any more)."""
    from shoal.engine.compatibility import ResolvedArgs, violations
    from shoal.engine.engine_args import EngineArgs

    path, hf = tiny_v32
    assert violations(ResolvedArgs(EngineArgs(), "generate", "cuda", 256, hf.config)) == []
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=64, max_model_len=64, attention_backend="triton")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 21)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 3)


def _fp8_engine_runs(path, backend: str, **engine) -> SimpleNamespace:
    """Greedy runs of the tiny V3.2 (top-8) with an FP8 cache on `backend`: prompts of 6
    and 23 tokens (in chunks of 16 beside decodes), then one sharing the second's first 16
    tokens (a prefix hit). Returns both runs, the prefix hits, each layer's cache read back
    as values ((latent rows, indexer keys) per layer, float32) and the CUDA-graph replays."""
    from kv_fp8_helpers import greedy_run

    from shoal.attention import kv_quant
    from shoal.layers.latent_attention import LatentAttention

    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=64, max_model_len=32, kv_cache_dtype="fp8",
              attention_backend=backend, **engine)
    try:
        runner = llm.llm_engine.core.runner
        assert type(runner.backend).__name__.lower().startswith(backend)
        replays: list = []
        if runner.graphs is not None:
            real_run = runner.graphs.run
            runner.graphs.run = lambda shape, *a: replays.append(shape) or real_run(shape, *a)
        rng = random.Random(8)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 23)]
        after = [prompts[1][:16] + [7, 9, 11]]
        runs = [greedy_run(llm, prompts, 4), greedy_run(llm, after, 4)]
        rows = []
        for layer in runner.model.attention_layers():
            stored = layer.kv_cache[0, :, 0].cpu()
            assert stored.dtype == kv_quant.FP8_KV_DTYPE
            if isinstance(layer, LatentAttention):
                rows.append(kv_quant.dequantize(stored, layer.kv_scale, torch.float32))
            else:
                rows.append(layer.fp8_keys.dequantize(stored, torch.float32))
        return SimpleNamespace(runs=runs, hits=llm.llm_engine.core.scheduler.kv.prefix_hits,
                               rows=rows, replays=len(replays))
    finally:
        llm.shutdown()


def _same_fp8_runs(got: SimpleNamespace, want: SimpleNamespace, atol: float) -> None:
    """The same prefix hits, tokens and cached rows (_fp8_rows_agree); logprobs within atol."""
    assert got.hits == want.hits >= 16
    for a, b in zip(got.runs, want.runs, strict=True):
        assert a.tokens == b.tokens
        for x, y in zip(a.logits, b.logits):
            for u, v in zip(x, y):
                torch.testing.assert_close(torch.log_softmax(u, -1), torch.log_softmax(v, -1),
                                           atol=atol, rtol=0)
    for a, b in zip(got.rows, want.rows, strict=True):
        _fp8_rows_agree(a, b)


def _fp8_rows_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """Caches of FP8 rows read back (slot rows x values): the same rows written, equal up to
    what the backends' different float32 sum orders do to the rows' inputs: a block's scale
    drifts (under 1e-4 measured), and a few values cross an e4m3 rounding boundary, one step
    (at most 1/8 of the value) each. A wrong slot, layout or scale misses by far more."""
    written = want.abs().amax(-1) > 0
    assert written.sum() > 30 and torch.equal(written, got.abs().amax(-1) > 0)
    got, want = got[written], want[written]
    size = torch.maximum(got.abs(), want.abs())
    off = (got - want).abs()
    crossed = off > 1e-3 * size
    assert crossed.float().mean() < 0.01, f"{int(crossed.sum())} of {off.numel()} values moved"
    assert (off <= size / 8 + 2.0 ** -9).all()


def test_tiny_v32_engine_fp8_cache_on_triton_is_the_torch_backends(tiny_v32):
    """kv_cache_dtype='fp8' on the Triton backend (block-scaled FP8 indexer keys written and
    scored on the device, the latent rows read by the sparse kernel) gives the torch
    backend's FP8 run past index_topk, in chunks beside decodes and after a prefix hit: the
    same tokens and cached rows; logprobs within 5e-3. (Not 1e-5: the two backends' float32
    sums differ in order (logprobs 6.7e-6 apart without FP8), which flips one latent value
    of layer 1 across an e4m3 rounding boundary here, and that moves these random models'
    logprobs by up to 5.3e-4, measured. Each layer alone writes and reads the same bytes on
    both backends: test_mixed_step_matches_the_torch_sparse_path[fp8].)"""
    path = tiny_v32[0]
    _same_fp8_runs(_fp8_engine_runs(path, "triton"), _fp8_engine_runs(path, "torch"), 5e-3)


# ---- on a GPU: V3.2's shapes ------------------------------------------------------------

def _v32_step(rows: int, context: int, gen: torch.Generator, bs: int = 64, k: int = 2048):
    """128 heads of Dk 576 (512 + 64) in bf16, a cache of `context` tokens' blocks that every
    row's table lists in its own order, rows of lengths near `context` (one of 1000 < top-k,
    its tail picks past it; with several rows a padding row), picks the best of random
    scores (visible first, as torch.topk gives them)."""
    dev, dtype = "cuda", torch.bfloat16
    nb = context // bs
    cache = torch.randn(nb * bs, 576, generator=gen, device=dev).to(dtype)
    tables = torch.stack([torch.randperm(nb, generator=gen, device=dev)
                          for _ in range(rows)]).to(torch.int32)
    seen = torch.randint(context // 2, context + 1, (rows,), generator=gen, device=dev)
    seen[0] = context
    if rows > 2:
        seen[1], seen[2] = 1000, 0
    scores = torch.rand(rows, context, generator=gen, device=dev)
    scores[torch.arange(context, device=dev)[None, :] >= seen[:, None]] = -1.0
    picks = scores.topk(k, dim=-1).indices.to(torch.int32)
    q = (torch.randn(rows, 128, 576, generator=gen, device=dev) * 0.3).to(dtype)
    rows_ = SparseRows(picks, seen.to(torch.int32),
                       torch.arange(rows, dtype=torch.int32, device=dev))
    return q, cache, tables, rows_, bs


def _gathered_reference(q, cache, tables, rows: SparseRows, bs: int, scale: float
                        ) -> torch.Tensor:
    """The torch form: gather each row's picked latents, a masked float32 softmax."""
    pos = rows.picks.long()
    valid = (pos >= 0) & (pos < rows.seen[:, None]) \
        & (torch.arange(pos.shape[1], device=pos.device)[None, :] < rows.seen[:, None])
    pos = pos.clamp(min=0)
    t = tables.long()[rows.table_rows.long()]
    slots = t.gather(1, (pos // bs).clamp(max=t.shape[1] - 1)) * bs + pos % bs
    lat = cache[slots].float()  # [R, K, Dk]
    s = torch.einsum("rhd,rkd->rhk", q.float(), lat) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("rhk,rkd->rhd", p, lat[..., :512])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, context", [(1, 8192), (32, 8192), (1, 131072), (64, 32768),
                                           (128, 131072)])
def test_v32_shapes_on_gpu(rows: int, context: int):
    """The kernel against the gathered torch form (bf16), a CUDA graph replayed with other
    picks and counts, and the times: the kernel (several tilings), the torch form, and dense
    MLA decode over each row's whole context (what the sparse read replaces)."""
    from triton.runtime.errors import OutOfResources

    from shoal.attention.ops.mla_decode import mla_paged_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, cache, tables, rows_, bs = _v32_step(rows, context, gen)
    scale = 576 ** -0.5
    out = mla_sparse_attention(q, cache, tables, rows_, bs, scale, 512)
    want = _gathered_reference(q, cache, tables, rows_, bs, scale)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    if rows > 2:
        assert torch.count_nonzero(out[2]) == 0

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = mla_sparse_attention(q, cache, tables, rows_, bs, scale, 512)
    _, _, _, moved, _ = _v32_step(rows, context, torch.Generator(device="cuda").manual_seed(1))
    rows_.picks.copy_(moved.picks)
    rows_.seen.copy_(moved.seen)
    graph.replay()
    torch.testing.assert_close(out_g.float(), _gathered_reference(q, cache, tables, rows_, bs,
                                                                  scale), atol=2e-2, rtol=2e-2)

    def timed(fn) -> str:
        try:
            return f"{time_ms(fn) * 1e3:.0f} us"
        except OutOfResources as e:
            return f"does not fit ({e})"
    lens = rows_.seen.clamp(min=0)
    print(f"\n[sparse MLA rows={rows} context={context} top-2048] "
          f"triton {timed(lambda: mla_sparse_attention(q, cache, tables, rows_, bs, scale, 512))}"
          f", graph replay {timed(graph.replay)}, torch gather "
          f"{timed(lambda: _gathered_reference(q, cache, tables, rows_, bs, scale))}, dense "
          f"MLA decode {timed(lambda: mla_paged_decode(q, cache, tables, lens, bs, scale, 512))}")
    for block_h, warps, splits, block_n in [(16, 4, None, None), (16, 8, None, None),
                                            (16, 4, 1, None), (16, 4, None, 16),
                                            (16, 4, None, 64), (32, 4, None, None),
                                            (32, 8, None, None), (64, 8, None, None),
                                            (64, 8, 1, 16)]:
        def run(bh=block_h, nw=warps, ns=splits, bn=block_n) -> None:
            mla_sparse.launch(q, cache, tables, rows_, bs, scale, 512, block_h=bh,
                              num_warps=nw, num_splits=ns, block_n=bn)
        print(f"  block_h={block_h} num_warps={warps} splits={splits or 'auto'} "
              f"block_n={block_n or 'auto'}: {timed(run)}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows, context", [(1, 32768), (32, 32768), (8, 131072)])
def test_v32_indexer_picks_on_gpu(rows: int, context: int, fp8: bool):
    """The indexer's picks on the Triton metadata at V3.2's shapes (64 index heads of 128,
    top-2048, decodes at `context`): each row's picks carry the torch scores' top-k values
    (ties may pick other positions of equal score); the time of scores + top-k. fp8: the
    keys stored as the FP8 cache keeps them (e4m3, a scale per 128 values), scored against
    the torch scores of the keys read back."""
    from shoal.attention.fp8_rows import BlockScaledRows
    from shoal.layers.sparse_picks import pick_rows

    gen = torch.Generator(device="cuda").manual_seed(2)
    bs, nb = 64, context // 64
    pages = torch.randn(nb, bs, 128, generator=gen, device="cuda").to(torch.bfloat16)
    layout = BlockScaledRows.of((128, 128)) if fp8 else None
    stored = pages
    if layout is not None:
        stored = layout.quantize(pages)  # [nb, bs, 144] bytes (132 padded to 16)
        pages = layout.dequantize(stored, torch.float32)
    tables = [torch.randperm(nb, generator=gen, device="cuda").tolist() for _ in range(rows)]
    lens = [context - 1 - 17 * i for i in range(rows)]
    md = TritonAttentionBackend().build_metadata(
        query_lens=[1] * rows, context_lens=lens, block_tables=tables, block_size=bs,
        num_decodes=rows, sliding_window=None, device=torch.device("cuda"), null_block=0)
    q = torch.randn(rows, 64, 128, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(rows, 64, generator=gen, device="cuda") * 0.125
    scale = 128 ** -0.5
    picked = pick_rows(q, w, md, stored, 2048, scale, layout)
    keys = pages.reshape(-1, 128)[(md.block_tables.long()[:, :, None] * bs
                                   + torch.arange(bs, device="cuda")).view(rows, -1)].float()
    s = torch.einsum("rhd,rsd->rhs", q.float(), keys).relu() * scale
    s = torch.einsum("rh,rhs->rs", w, s)
    s = s.masked_fill(torch.arange(s.shape[1], device="cuda")[None, :]
                      >= md.seq_lens[:, None], float("-inf"))
    want = s.topk(2048, dim=-1).values
    got = s.gather(1, picked.picks.long()).sort(-1, descending=True).values
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert picked.seen.tolist() == [n + 1 for n in lens]
    print(f"\n[indexer picks rows={rows} context={context} {'fp8' if fp8 else 'bf16'} keys] "
          f"{time_ms(lambda: pick_rows(q, w, md, stored, 2048, scale, layout)) * 1e3:.0f} us")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, context", [(1, 32768), (32, 32768), (8, 131072)])
def test_v32_fp8_index_scores_on_tensor_cores_on_gpu(rows: int, context: int):
    """The indexer's scores alone over FP8 keys at test_v32_indexer_picks_on_gpu's shapes:
    bf16 queries on tensor cores (the e4m3 tile converted exactly, each key's scale times the
    float32 dot) and float32 queries (the float32 path) each within float32's sum error of
    the float64 scores of the keys read back (the bound of tests/attention/
    test_fp8_index_scores.py); the same bits on a second run and from a CUDA graph replayed
    at other positions. Prints both paths' times, bf16 keys', top-2048's alone, and the
    tensor-core path's at other tilings."""
    from shoal.attention.fp8_rows import BlockScaledRows
    from shoal.attention.ops import v4_index_scores as index_ops
    from shoal.attention.ops.v4_paged_keys import PagedKeys

    gen = torch.Generator(device="cuda").manual_seed(3)
    bs, nb, heads, dim = 64, context // 64, 64, 128
    values = torch.randn(nb, bs, dim, generator=gen, device="cuda").to(torch.bfloat16)
    layout = BlockScaledRows.of((dim, 128))
    stored = layout.quantize(values)
    tables = torch.stack([torch.randperm(nb, generator=gen, device="cuda")
                          for _ in range(rows)]).to(torch.int32)
    positions = torch.tensor([context - 1 - 17 * i for i in range(rows)], device="cuda")
    q = torch.randn(rows, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(rows, heads, generator=gen, device="cuda") * 0.125
    scale = dim ** -0.5
    fp8_keys, bf16_keys = PagedKeys(stored, tables, layout), PagedKeys(values, tables)

    def scores(queries: torch.Tensor, keys: PagedKeys = fp8_keys, pos: torch.Tensor = positions,
               **tiling) -> torch.Tensor:
        return index_ops.launch(queries, w, pos, keys, 0, 1, bs, scale, **tiling)
    cores, plain = scores(q), scores(q.float())
    keys = layout.dequantize(stored, torch.float64).view(-1, dim)
    for r in range(rows):
        k = keys[(tables[r].long()[:, None] * bs + torch.arange(bs, device="cuda")).view(-1)]
        qr, wr = q[r].double(), w[r].double()
        exact = (wr[:, None] * (qr @ k.T).relu()).sum(0) * scale
        size = (wr.abs()[:, None] * (qr.abs() @ k.abs().T)).sum(0) * scale
        bound = (dim + heads + 6) * 2.0 ** -23 * size
        seen = int(positions[r]) + 1
        for name, out in (("tensor cores", cores), ("float32 path", plain)):
            assert out[r, seen:].isneginf().all(), name
            err = (out[r, :seen].double() - exact[:seen]).abs() / bound[:seen]
            assert err.max() <= 1, f"{name}, row {r}: {err.max().item():.2f}x the bound"
    assert torch.equal(scores(q), cores)
    moved = positions.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = scores(q, pos=moved)
    moved.sub_(1000)
    graph.replay()
    assert torch.equal(replayed, scores(q, pos=moved))
    past = torch.arange(context, device="cuda")[None, :] > moved[:, None]
    assert torch.equal(replayed, cores.masked_fill(past, float("-inf")))

    def us(fn) -> str:
        return f"{time_ms(fn) * 1e3:.0f} us"
    print(f"\n[indexer scores rows={rows} context={context} fp8 keys] tensor cores "
          f"{us(lambda: scores(q))}, float32 path {us(lambda: scores(q.float()))}, bf16 keys "
          f"{us(lambda: scores(q, bf16_keys))}; top-2048 alone {us(lambda: cores.topk(2048))}")
    for block_n, warps in [(16, 4), (64, 4), (64, 8), (128, 8)]:
        print(f"  tensor cores block_n={block_n} num_warps={warps}: "
              f"{us(lambda bn=block_n, nw=warps: scores(q, block_n=bn, num_warps=nw))}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_v32_engine_with_cuda_graphs(tmp_path):
    """The tiny V3.2 (top-8) on CUDA's defaults (the Triton backend, CUDA graphs), fp32:
    transformers' tokens and logprobs (1e-4); the decode steps replay graphs, which select
    (their tables hold more than top-k positions)."""
    path, hf = write_deepseek(tmp_path / "v32", "deepseek_v32", 3,
                              **dict(V3, index_n_heads=8, index_head_dim=32, index_topk=TOPK))
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
              max_num_seqs=8, num_gpu_blocks_override=256, max_model_len=128)
    runner = llm.llm_engine.core.runner
    assert type(runner.backend).__name__ == "TritonAttentionBackend"
    replays: list = []
    if runner.graphs is not None:
        real_run = runner.graphs.run
        runner.graphs.run = lambda shape, *a: replays.append(shape) or real_run(shape, *a)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 12, 30, 61)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 12)
    assert replays, "no step replayed a CUDA graph"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_v32_fp8_cache_with_cuda_graphs(tiny_v32):
    """On CUDA, fp32, kv_cache_dtype='fp8': the Triton backend with CUDA graphs (the FP8
    indexer keys quantized and written inside the captured decode steps, which select)
    gives the eager torch backend's FP8 run: tokens, cached rows, logprobs within 5e-3."""
    path = tiny_v32[0]
    graphs = _fp8_engine_runs(path, "triton")
    assert graphs.replays, "no step replayed a CUDA graph"
    _same_fp8_runs(graphs, _fp8_engine_runs(path, "torch", enforce_eager=True), 5e-3)
