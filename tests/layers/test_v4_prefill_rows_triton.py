"""DeepSeek-V4's prefill chunks and verify steps through the row kernels
(CompressedAttention._attend_spans_triton: every token a row of v4_decode_attention.py and
v4_index_scores.py at its own position, over its request's tables, shoal/layers/span_rows.py)
under TRITON_INTERPRET=1, against the torch path of the real layer (_attend, request by
request): a mixed step of decodes and chunks through the whole layer forward, so the order of
the writes is the layer's own (the step's window rows and the entries of the groups its chunks
close stored before any token reads). Chunks start mid-window and mid-group, cross CSA (m = 4)
and HCA (m' = 16) group boundaries, fresh prompts shorter and longer than the window; the
steps' metadata from both backends' builders (the torch backend gives a fresh prompt no table
in a full-attention group: its blocks come from its slots); CSA picking its top-k, and reading
every entry; an FP8 pool. The tiny V4 engine with the kernels on gives the torch path's tokens
with chunked prefills and prefix hits. The GPU test times a 32k-token prefill, chunk by chunk,
at V4-Flash shapes: the torch path against the kernels."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from gpu_timing import time_ms  # noqa: E402
from layers.test_v4_decode_attention_triton import _cfg  # noqa: E402
from models.test_deepseek_v4 import tiny  # noqa: E402, F401 (fixture)

import shoal.layers.compressed_attention as ca  # noqa: E402
from shoal.attention.kv_quant import FP8_KV_DTYPE  # noqa: E402
from shoal.attention.metadata import GroupedMetadata, build_attention_metadata  # noqa: E402
from shoal.attention.ops import v4_decode_attention as attn_ops  # noqa: E402
from shoal.attention.triton_backend import build_triton_attention_metadata  # noqa: E402
from shoal.layers.compressed_attention import CSA, HCA, SLIDING  # noqa: E402
from shoal.layers.request_spans import StepSpans  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BS = 4
# (context, new tokens), window 8, CSA m = 4, HCA m' = 8: two decodes, then a chunk from inside
# the window and a group closing CSA's and HCA's first groups, one from past the window and
# inside groups closing CSA's 5th and 6th and HCA's 3rd, a fresh prompt shorter than the window,
# a fresh one past the window closing groups
REQUESTS = [(21, 1), (9, 1), (5, 6), (18, 6), (0, 3), (0, 10)]
RATES = {CSA: 4, HCA: 8}
NUM_BLOCKS = 48


def _layer(cfg, dtype: torch.dtype, pool_dtype: torch.dtype, gen: torch.Generator,
           bs: int = BS, num_blocks: int = NUM_BLOCKS) -> ca.CompressedAttention:
    """The layer with random weights and random caches in the pool's layout (groups: 0 the
    window's rows, 1 the entries, 2 the open groups' inputs), each cache holding rows as its
    reads give them back (FP8 where the pool is)."""
    with torch.device(DEV):
        layer = ca.CompressedAttention(cfg, 0, dtype)
    with torch.no_grad():
        for p in layer.parameters():  # (outputs of a few units whatever the fan-in)
            values = (torch.randn(p.shape, generator=gen, device=DEV) * 2 / p.shape[-1] ** 0.5
                      if p.dim() > 1 else torch.rand(p.shape, generator=gen, device=DEV) + 0.5)
            p.copy_(values)
    for group, rows in enumerate(layer.paged_layers()):
        row = rows.kv_cache_spec(pool_dtype.itemsize).slot_row(bs)[2]
        rows.kv_cache = torch.zeros(1, num_blocks * bs, 1, row, dtype=pool_dtype, device=DEV)
        rows.kv_group = group
        stored = rows._pages(bs) if rows is layer.entries else rows._rows()
        values = torch.randn(*stored.shape[:-1], rows.width, generator=gen, device=DEV)
        stored.copy_(rows.encode(values.to(dtype)))
    return layer


def _windows(layer: ca.CompressedAttention) -> list[int | None]:
    return [rows.sliding_window for rows in layer.paged_layers()]


def _step(layer: ca.CompressedAttention, requests: list[tuple[int, int]], num_decodes: int,
          backend: str, gen: torch.Generator, bs: int = BS, num_blocks: int = NUM_BLOCKS
          ) -> tuple[StepSpans, torch.Tensor]:
    """The step's spans and positions from the backend's metadata builder, each request with
    random distinct blocks in each group (a sliding group's too, behind its window: what a
    token must not read holds random rows)."""
    query = [n for _, n in requests]
    context = [c for c, _ in requests]
    mds = []
    for window in _windows(layer):
        ids = (torch.randperm(num_blocks - 1, generator=gen, device=gen.device) + 1).tolist()
        tables = []
        for c, n in requests:
            need = -(-(c + n) // bs)
            tables.append(ids[:need])
            ids = ids[need:]
        args = dict(query_lens=query, context_lens=context, block_tables=tables,
                    block_size=bs, num_decodes=num_decodes, sliding_window=window,
                    device=torch.device(DEV))
        mds.append(build_attention_metadata(**args, null_block=0) if backend == "torch"
                   else build_triton_attention_metadata(**args))
    positions = torch.tensor([c + i for c, n in requests for i in range(n)], device=DEV)
    return StepSpans.of(GroupedMetadata(tuple(mds)), positions), positions


def _both_paths(layer: ca.CompressedAttention, hidden: torch.Tensor, make_step, monkeypatch
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(the torch path's attention [T, H, D] and layer output, the kernels', how many times the
    kernels ran the spans), each from the same caches on a step of its own."""
    caches = [rows.kv_cache.clone() for rows in layer.paged_layers()]
    attended: list[torch.Tensor] = []
    spans_runs: list[int] = []
    attend_step, attend_spans = ca.CompressedAttention._attend_step, \
        ca.CompressedAttention._attend_spans_triton

    def kept(self, ctx, step):
        attended.append(attend_step(self, ctx, step))
        return attended[-1]

    def counted(self, ctx, step):
        spans_runs.append(len(step.spans))
        return attend_spans(self, ctx, step)

    monkeypatch.setattr(ca.CompressedAttention, "_attend_step", kept)
    monkeypatch.setattr(ca.CompressedAttention, "_attend_spans_triton", counted)
    outs = []
    for on in (False, True):
        for rows, cache in zip(layer.paged_layers(), caches):
            rows.kv_cache.copy_(cache)
        monkeypatch.setattr(ca, "use_triton", lambda x, enabled, on=on: on and enabled)
        step, positions = make_step()
        with torch.no_grad():
            outs.append(layer(positions, hidden, step))
    return attended[0], outs[0], attended[1], outs[1], len(spans_runs)


@pytest.mark.parametrize("kind, topk, backend, fp8, grid_rows", [
    (SLIDING, 4, "torch", False, None), (HCA, 4, "torch", False, None),
    (CSA, 2, "torch", False, None), (CSA, 16, "triton", False, None),
    (CSA, 2, "triton", True, 7)],
    ids=["sliding", "hca", "csa-topk", "csa-every-entry-triton-md",
         "csa-topk-fp8-triton-md-launch-pieces"])
def test_mixed_step_matches_the_torch_path(kind: str, topk: int, backend: str, fp8: bool,
                                           grid_rows: int | None, monkeypatch):
    """Decodes beside chunks: every span token's attention equals the torch path's, and so
    does the layer's output (decodes included). grid_rows: the rows one attention launch
    takes (more run as several launches, as past CUDA's grid limit)."""
    if grid_rows is not None:
        monkeypatch.setattr(attn_ops, "MAX_GRID_ROWS", grid_rows)
    gen = torch.Generator(DEV).manual_seed(0)
    cfg = _cfg(kind, topk, compress_rates=RATES)
    layer = _layer(cfg, torch.float32, FP8_KV_DTYPE if fp8 else torch.float32, gen)
    assert layer.window_rows.quantized == fp8
    t = sum(n for _, n in REQUESTS)
    hidden = torch.randn(t, cfg.hidden_size, generator=gen, device=DEV)

    def make_step():
        return _step(layer, REQUESTS, 2, backend, torch.Generator(DEV).manual_seed(1))
    step, _ = make_step()
    assert [s.context for s in step.spans] == [c for c, _ in REQUESTS[2:]]
    if kind == CSA:  # (the top-k picks only past top-k entries: 6 table columns, 6 entries)
        assert (layer.indexer.topk < 6) == (topk == 2)
    ref_attn, ref, attn, out, runs = _both_paths(layer, hidden, make_step, monkeypatch)
    assert runs == 1  # (the spans went through the kernels, once for the step)
    torch.testing.assert_close(attn, ref_attn, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)


def test_long_chunks_score_in_bounded_pieces(monkeypatch):
    """The spans' rows (a short fresh prompt beside a chunk after 20 cached tokens: tables
    of 7 entries, top-2) scored in pieces whose scores and top-k outputs, rows x (entries +
    3 top-k), stay within the budget: without the rows' lengths (what a graph's decodes
    take) pieces of budget // (7 + 6) rows over every column; with them (an eager step's
    spans) each piece over the columns its rows reach, the prompt's apart from the chunk's.
    Every row's visible picks (the ones read) are the one whole piece's; int32 on every
    path."""
    import shoal.attention.ops.v4_index_scores as index_ops
    import shoal.layers.compressed_indexer as ci

    gen = torch.Generator(DEV).manual_seed(2)
    layer = _layer(_cfg(CSA, 2, compress_rates=RATES), torch.float32, torch.float32, gen)
    requests = [(9, 1), (0, 5), (20, 8)]
    hidden = torch.randn(14, 32, generator=gen, device=DEV)
    pick_rows, scores = ci.CompressedIndexer.pick_rows, index_ops.v4_index_scores
    launches: list[tuple[int, int]] = []  # each piece's (rows, entries)
    runs: dict[str, tuple[torch.Tensor, list[tuple[int, int]]]] = {}

    def counted(q, *args, **kwargs):
        out = scores(q, *args, **kwargs)
        launches.append(tuple(out.shape))
        return out

    def each_way(self, *args):
        if len(args) < 8:  # (the decode's)
            return pick_rows(self, *args)
        for name, budget, lens in (("whole", 1 << 26, None), ("fixed", 4 * 13, None),
                                   ("cut", 1 << 26, args[7]), ("cut-budget", 4 * 13, args[7])):
            monkeypatch.setattr(ci, "SCORE_ELEMENTS", budget)
            launches.clear()
            runs[name] = pick_rows(self, *args[:7], lens), list(launches)
        runs["positions"] = args[2], []
        return runs["cut"][0]
    monkeypatch.setattr(ci.CompressedIndexer, "pick_rows", each_way)
    monkeypatch.setattr(index_ops, "v4_index_scores", counted)
    monkeypatch.setattr(ca, "use_triton", lambda x, enabled: enabled)
    step, positions = _step(layer, requests, 1, "triton", torch.Generator(DEV).manual_seed(3))
    with torch.no_grad():
        layer(positions, hidden, step)
    assert runs["whole"][1] == [(13, 7)]
    assert runs["fixed"][1] == [(4, 7)] * 3 + [(1, 7)]
    # the prompt's rows reach 2 entries (top-2's least), the chunk's first 6 then 7
    assert runs["cut"][1] == [(5, 2), (8, 7)]
    assert runs["cut-budget"][1] == [(5, 2), (4, 6), (4, 7)]
    whole = runs["whole"][0]
    visible = ((runs["positions"][0] + 1) // 4).clamp(max=2).tolist()
    assert sum(visible) > 13  # (most rows see both picks)
    for name in ("whole", "fixed", "cut", "cut-budget"):
        picks = runs[name][0]
        assert picks.shape == (13, 2) and picks.dtype == torch.int32, name
        for row, n in enumerate(visible):
            assert torch.equal(picks[row, :n], whole[row, :n]), (name, row)


def test_fp8_rows_stored_without_reading_them_back(monkeypatch):
    """write and store with want_rows=False (where only the caches are read: the kernels, a
    decode graph): the bytes stored as with the rows read back, None returned and nothing
    dequantized; with it, the rows as a later read gives them (rounded)."""
    from shoal.attention.fp8_rows import BlockScaledRows

    gen = torch.Generator(DEV).manual_seed(4)
    layer = _layer(_cfg(CSA, 2, compress_rates=RATES), torch.float32, FP8_KV_DTYPE, gen)
    step, _ = _step(layer, REQUESTS, 2, "triton", torch.Generator(DEV).manual_seed(5))
    span = step.spans[-1]  # (the fresh prompt closing groups 0 and 1)
    kv = torch.randn(sum(n for _, n in REQUESTS), layer.head_dim, generator=gen, device=DEV)
    entries = torch.randn(2, layer.entries.width, generator=gen, device=DEV)
    writes = ((layer.window_rows, kv,
               lambda want: layer.window_rows.write(kv, step, want_rows=want)),
              (layer.entries, entries,
               lambda want: layer.entries.store(entries, 0, step, span, want_rows=want)))
    for paged, values, write in writes:
        before = paged.kv_cache.clone()
        back = write(True)
        stored = paged.kv_cache.clone()
        assert not torch.equal(stored.view(torch.uint8), before.view(torch.uint8))
        assert back.shape == values.shape and not torch.equal(back, values)  # (rounded)
        paged.kv_cache.copy_(before)
        with monkeypatch.context() as m:
            m.setattr(BlockScaledRows, "dequantize", lambda *a, **k: pytest.fail("read back"))
            assert write(False) is None
        assert torch.equal(paged.kv_cache.view(torch.uint8), stored.view(torch.uint8))


def test_tiny_engine_prefills_with_the_kernels_give_the_torch_paths_tokens(tiny, monkeypatch):  # noqa: F811
    """The tiny V4 checkpoint (window 8, CSA m = 4 with top-4, HCA m' = 16), fp32, with the
    kernels forced on (interpreted on the CPU) for every chunk, verify step and decode: a
    prompt past the window, HCA's group and CSA's top-k x m in chunks of 8 tokens beside
    another request's prefill and decodes, then one hitting its first 20 tokens in the prefix
    cache (ending inside an HCA group); drafts of the torch path's own tokens (some wrong, so
    verify steps accept some and reject others): the torch path's greedy tokens, logprobs
    within 1e-4."""
    from models.test_deepseek_v4 import _prompts
    from oracle import draft_continuations

    from shoal import LLM, SamplingParams

    path, _ = tiny
    first = _prompts((5, 21), seed=8)
    again = [first[1][:20] + [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    spans: list[list[tuple[int, int]]] = []
    attend = ca.CompressedAttention._attend_spans_triton

    def counted(self, ctx, step):
        spans.append([(s.context, s.length) for s in step.spans])
        return attend(self, ctx, step)

    def generate(**spec) -> tuple[list, int]:
        llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=8,
                  num_gpu_blocks_override=64, max_model_len=64, **spec)
        try:
            outs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False) for prompts in (first, again)]
            return [o.outputs[0] for o in outs[0] + outs[1]], outs[1][0].num_cached_tokens
        finally:
            llm.shutdown()
    monkeypatch.setattr(ca, "use_triton", lambda x, enabled: False)
    ref, ref_hit = generate()
    draft_continuations(monkeypatch, {tuple(p): o.token_ids for p, o in
                                      zip(first + again, ref)}, k=2)
    monkeypatch.setattr(ca, "use_triton", lambda x, enabled: enabled)
    monkeypatch.setattr(ca.CompressedAttention, "_attend_spans_triton", counted)
    out, hit = generate(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert hit == ref_hit == 20
    assert max(map(len, spans)) >= 2  # (every layer's chunks, two requests' at once too)
    # verify steps: drafts after the 21-token prompt (its chunks and the hit's end by 23)
    assert any(c >= 21 and n > 1 for step in spans for c, n in step)
    for got, want in zip(out, ref):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            (tok, lp), = ((t, v.logprob) for t, v in a.items() if t in b)
            assert abs(lp - b[tok].logprob) < 1e-4


_ORIGINAL_ATTEND_STEP = ca.CompressedAttention._attend_step


def _prefill_steps(layer: ca.CompressedAttention, hidden: torch.Tensor, chunk: int, bs: int,
                   gen: torch.Generator) -> list[tuple[StepSpans, torch.Tensor, torch.Tensor]]:
    """One prompt of hidden's tokens, `chunk` a step (the Triton backend's metadata): each
    step's spans, positions and hidden rows. Random blocks, the same in every group."""
    total, device = hidden.shape[0], hidden.device
    num_blocks = layer.window_rows.kv_cache.shape[1] // bs
    blocks = (torch.randperm(num_blocks - 1, generator=gen, device=gen.device) + 1).tolist()
    steps = []
    for c in range(0, total, chunk):
        n = min(chunk, total - c)
        mds = [build_triton_attention_metadata(
            query_lens=[n], context_lens=[c], block_tables=[blocks[:-(-(c + n) // bs)]],
            block_size=bs, num_decodes=0, sliding_window=w, device=device)
            for w in _windows(layer)]
        positions = torch.arange(c, c + n, device=device)
        steps.append((StepSpans.of(GroupedMetadata(tuple(mds)), positions), positions,
                      hidden[c:c + n]))
    return steps


def _prefill(layer: ca.CompressedAttention, steps: list, kernels: bool, monkeypatch,
             attended: list | None = None) -> None:
    """The steps through the layer, the spans on the kernels or in torch; attended: where to
    keep each step's attention output (_attend_step's), or None."""
    attend_step = _ORIGINAL_ATTEND_STEP

    def kept(self, ctx, step):
        attended.append(attend_step(self, ctx, step))
        return attended[-1]

    monkeypatch.setattr(ca, "use_triton", lambda x, enabled: kernels and enabled)
    monkeypatch.setattr(ca.CompressedAttention, "_attend_step",
                        attend_step if attended is None else kept)
    with torch.no_grad():
        for step, positions, x in steps:
            step.indices.clear()  # (what the step's first layer builds: timed too)
            layer(positions, x, step)


def _compare_chunked_prefill(layer: ca.CompressedAttention, steps: list, monkeypatch,
                             tol: float) -> None:
    """Each step's attention through the kernels against the torch path: all but a few rows
    (< 1 in 1000: an indexer's near tie may pick another entry) within tol (abs + rel)."""
    ref: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    _prefill(layer, steps, False, monkeypatch, ref)
    _prefill(layer, steps, True, monkeypatch, out)
    for a, b in zip(out, ref):
        far = ((a.float() - b.float()).abs() > tol + tol * b.float().abs()).flatten(1).any(1)
        assert far.float().mean() < 1e-3, f"{int(far.sum())} of {len(far)} rows differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", [CSA, HCA, SLIDING])
@pytest.mark.parametrize("chunk", [2048, 16384])
def test_v4_flash_prefill_32k_on_gpu(kind: str, chunk: int, monkeypatch):
    """A 32k-token prompt prefilled `chunk` tokens a step through one V4-Flash attention layer
    (64 heads of 512, window 128, CSA m = 4 with 64 indexer heads of 128 and top-512, HCA
    m' = 128), bf16, blocks of 64: each chunk's attention through the kernels matches the torch
    path (a few bf16 ulps: the torch path rounds its scores to bf16), and both paths' times
    over the whole prompt are printed, the layer's and its attention's (_attend_step)."""
    device, dtype, bs, total = "cuda", torch.bfloat16, 64, 32768
    gen = torch.Generator(device=device).manual_seed(0)
    cfg = _cfg(kind, 512, hidden_size=4096, num_attention_heads=64, o_groups=8, head_dim=512,
               sliding_window=128, o_lora_rank=1024, q_lora_rank=1024,
               compress_rates={CSA: 4, HCA: 128}, index_head_dim=128, index_n_heads=64,
               partial_rotary_factor=0.125, max_position_embeddings=1 << 20)
    layer = _layer(cfg, dtype, dtype, gen, bs, total // bs + 8)
    hidden = torch.randn(total, cfg.hidden_size, generator=gen, device=device, dtype=dtype)
    steps = _prefill_steps(layer, hidden, chunk, bs, gen)
    _compare_chunked_prefill(layer, steps, monkeypatch, 2e-2)

    def attention_ms(kernels: bool) -> float:
        """The attention's share of one prefill: CUDA events around each _attend_step."""
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def timed(self, ctx, step):
            events.append((torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
            out = _ORIGINAL_ATTEND_STEP(self, ctx, step)
            events[-1][1].record()
            return out
        _prefill(layer, steps, kernels, monkeypatch)  # (warm)
        with monkeypatch.context() as m:
            m.setattr(ca.CompressedAttention, "_attend_step", timed)
            m.setattr(ca, "use_triton", lambda x, enabled: kernels and enabled)
            with torch.no_grad():
                for step, positions, x in steps:
                    step.indices.clear()
                    layer(positions, x, step)
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in events)

    times = {}
    for kernels in (False, True):
        whole = time_ms(lambda k=kernels: _prefill(layer, steps, k, monkeypatch), iters=2)
        times[kernels] = whole, attention_ms(kernels)
    (t_whole, t_attn), (k_whole, k_attn) = times[False], times[True]
    print(f"\n[{kind} prefill of {total} tokens, chunks of {chunk}] layer: torch "
          f"{t_whole:.1f} ms, triton {k_whole:.1f} ms ({t_whole / k_whole:.1f}x); attention: "
          f"torch {t_attn:.1f} ms, triton {k_attn:.1f} ms ({t_attn / k_attn:.1f}x)")
