"""DeepSeek-V4's decode kernels (shoal/attention/ops/v4_decode_attention.py, v4_index_scores.py)
under TRITON_INTERPRET=1 against the torch decode path of the real layer
(CompressedAttention._attend_decodes), over random paged caches: rows shorter than the
window, rows with fewer entries than another row's (their tables poisoned past their own
blocks), a graph's padding row (position 0, zero table), on a sliding, an HCA and a CSA layer
(its indexer's top-k picking, and reading every entry when the tables hold no more than
top-k), with one and several key splits. The indexer's scores against its torch scores. The
GPU test runs V4-Flash shapes in bf16, in a CUDA graph, and prints both paths' times."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from gpu_timing import time_ms  # noqa: E402
from models.test_deepseek_v4 import tiny  # noqa: E402, F401 (fixture)

import shoal.layers.compressed_attention as ca  # noqa: E402
from shoal.attention.ops import v4_decode_attention as attn_ops  # noqa: E402
from shoal.attention.ops import v4_index_scores as index_ops  # noqa: E402
from shoal.attention.ops.v4_decode_attention import PagedKeys  # noqa: E402
from shoal.attention.ops.v4_index_scores import v4_index_scores  # noqa: E402
from shoal.layers.compressed_attention import CSA, HCA, SLIDING, _StepInputs  # noqa: E402
from shoal.layers.request_spans import StepSpans  # noqa: E402

TOL = {"atol": 2e-5, "rtol": 2e-5}
# the interpreter on the CPU; compiled on a GPU host (float32, as ieee products)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BS = 4  # block size
# positions: one shorter than the window (5: 6 rows of 8, 1 CSA entry), the longest (37), one
# with fewer entries than it (20), a padding row (0, its table zeros, slot -1)
POSITIONS = (5, 37, 20, 0)
WIDTH = 10  # table columns: 40 tokens (10 CSA entries, 2 HCA entries of 16)


def _cfg(kind: str, topk: int = 4, **dims) -> SimpleNamespace:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    base = dict(layer_types=[kind], hidden_size=32, rms_norm_eps=1e-6, num_attention_heads=4,
                o_groups=2, head_dim=32, sliding_window=8, o_lora_rank=8, q_lora_rank=16,
                compress_rates={CSA: 4, HCA: 16}, index_head_dim=32, index_n_heads=16,
                index_topk=topk, rope_parameters={"main": rope, "compress": rope},
                partial_rotary_factor=0.25, max_position_embeddings=4096)
    base.update(dims)
    return SimpleNamespace(**base)


def _layer(cfg: SimpleNamespace, dtype: torch.dtype, device: str, num_slots: int,
           gen: torch.Generator, block_size: int = BS) -> ca.CompressedAttention:
    """The layer with random sinks and caches: window rows in group 0, entries in group 1 (in
    the pool's layout: a block's page is its token slots of the spec's slot_row values, a
    fraction of an entry's width a slot)."""
    with torch.device(device):
        layer = ca.CompressedAttention(cfg, 0, dtype)
    layer.sinks.copy_(torch.randn(layer.num_heads, generator=gen, device=device))
    layer.window_rows.kv_cache = torch.randn(1, num_slots, 1, layer.head_dim, generator=gen,
                                             device=device).to(dtype)
    layer.window_rows.kv_group = 0
    if layer.entries is not None:
        row = layer.entries.kv_cache_spec(dtype.itemsize).slot_row(block_size)[2]
        layer.entries.kv_cache = torch.randn(1, num_slots, 1, row, generator=gen,
                                             device=device).to(dtype)
        layer.entries.kv_group = 1
    return layer


def _step(positions: list[int], width: int, num_blocks: int, padding: int, device: str,
          gen: torch.Generator, bs: int = BS) -> StepSpans:
    """Decodes at `positions` (the last `padding` of them a graph's padding rows: zero tables,
    slot -1), each with random distinct blocks in both groups' tables, every column (past a
    row's own blocks too: poison it must never read)."""
    rows = len(positions)
    tables = tuple(torch.stack([torch.randperm(num_blocks - 1, generator=gen,
                                               device=gen.device)[:width] + 1
                                for _ in range(rows)]).to(device) for _ in range(2))
    pos = torch.tensor(positions, device=device)
    slots = []
    for t in tables:
        if padding:
            t[rows - padding:] = 0
        s = t.gather(1, (pos // bs)[:, None].clamp(max=width - 1))[:, 0] * bs + pos % bs
        if padding:
            s[rows - padding:] = -1
        slots.append(s)
    return StepSpans((), tuple(slots), bs, rows, pos, tables)


def _inputs(layer: ca.CompressedAttention, rows: int, dtype: torch.dtype, device: str,
            gen: torch.Generator) -> _StepInputs:
    q = torch.randn(rows, layer.num_heads, layer.head_dim, generator=gen, device=device)
    ctx = _StepInputs(q.to(dtype), q.new_zeros(0))
    if layer.indexer is not None:
        ix = layer.indexer
        # (values of the model dtype, widened: what CompressedIndexer.queries gives)
        ctx.index_q = torch.randn(rows, ix.n_heads, ix.head_dim, generator=gen,
                                  device=device).to(dtype).float()
        ctx.index_w = torch.randn(rows, ix.n_heads, generator=gen, device=device)
    return ctx


def _both_paths(layer: ca.CompressedAttention, ctx: _StepInputs, make_step
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the torch path's decodes, the kernels'), each on a step of its own (no shared
    indices)."""
    layer.use_triton_ops = False
    ref = layer._attend_decodes(ctx, make_step())
    layer.use_triton_ops = True
    return ref, layer._attend_decodes_triton(ctx, make_step())


# MIN_SPLIT_KEYS 64: one split of a row's keys; 4: two or four splits and the combine
@pytest.mark.parametrize("kind, topk, min_split", [
    (SLIDING, 4, 64), (HCA, 4, 64), (HCA, 4, 4), (CSA, 4, 64), (CSA, 4, 4), (CSA, 16, 4)],
    ids=["sliding", "hca", "hca-splits", "csa-topk", "csa-topk-splits", "csa-every-entry"])
def test_decodes_match_the_torch_path(kind: str, topk: int, min_split: int, monkeypatch):
    monkeypatch.setattr(attn_ops, "MIN_SPLIT_KEYS", min_split)
    gen = torch.Generator(DEV).manual_seed(0)
    layer = _layer(_cfg(kind, topk), torch.float32, DEV, 64 * BS, gen)
    ctx = _inputs(layer, len(POSITIONS), torch.float32, DEV, gen)

    def make_step() -> StepSpans:
        return _step(list(POSITIONS), WIDTH, 64, 1, DEV, torch.Generator(DEV).manual_seed(1))
    if kind == CSA:  # (the layer's own choice: indexer + top-k only past top-k entries)
        step = make_step()
        picked = layer.indexer.pick_rows(ctx.index_q, ctx.index_w, step.decode_positions,
                                         PagedKeys(*layer.entries.decode_pages(step)), 32, BS)
        assert (picked is None) == (topk >= WIDTH * BS // 4)
    ref, out = _both_paths(layer, ctx, make_step)
    assert out.shape == ref.shape == (len(POSITIONS), 4, 32)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_match_the_torch_scores(dtype: torch.dtype):
    """Every entry the tables hold scored, -inf past each row's own (the padding row: all).
    bf16: the pages and the queries (bf16 values, as the model's are) in bf16, the kernel's
    tensor-core path; its products are exact, so it matches the float32 scores."""
    gen = torch.Generator(DEV).manual_seed(2)
    layer = _layer(_cfg(CSA), dtype, DEV, 64 * BS, gen)
    ctx = _inputs(layer, len(POSITIONS), dtype, DEV, gen)
    step = _step(list(POSITIONS), WIDTH, 64, 1, DEV, gen)
    ix, d = layer.indexer, layer.head_dim
    keys, own = layer.entries.load_decodes(step, slice(None), slice(d, None))
    ref = ix.scores(ctx.index_q, ctx.index_w, keys, own)
    out = v4_index_scores(ctx.index_q.to(dtype), ctx.index_w, step.decode_positions,
                          PagedKeys(*layer.entries.decode_pages(step)), d, 4, BS, ix.scale)
    assert out.shape == (len(POSITIONS), WIDTH * BS // 4)
    assert torch.equal(out.isinf(), ref.isinf()) and out[1].isfinite().sum() == 9
    torch.testing.assert_close(out, ref, **TOL)


def test_bad_inputs_are_refused():
    q = torch.zeros(2, 4, 24)
    keys = PagedKeys(torch.zeros(2, 4, 24), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="head_dim 24"):
        attn_ops.v4_decode_attention(q, torch.zeros(2), torch.zeros(4), 1.0, keys, 4, 4)
    q, keys = q[..., :16], PagedKeys(torch.zeros(2, 4, 16), keys.tables)
    with pytest.raises(ValueError, match="sinks has shape"):
        attn_ops.v4_decode_attention(q, torch.zeros(2), torch.zeros(3), 1.0, keys, 4, 4)
    with pytest.raises(ValueError, match="tables must be"):
        attn_ops.v4_decode_attention(q, torch.zeros(2), torch.zeros(4), 1.0,
                                     PagedKeys(keys.pages, keys.tables[:1]), 4, 4)
    with pytest.raises(ValueError, match="pages must be"):
        attn_ops.v4_decode_attention(q, torch.zeros(2), torch.zeros(4), 1.0,
                                     PagedKeys(keys.pages[0], keys.tables), 4, 4)
    with pytest.raises(ValueError, match=r"entries pages must be \[blocks, slots, >= 24\]"):
        v4_index_scores(q, torch.zeros(2, 4), torch.zeros(2), keys, 8, 4, 4, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", [CSA, HCA, SLIDING])
@pytest.mark.parametrize("rows, context", [(1, 1024), (32, 1024), (1, 32768), (32, 32768)])
def test_v4_flash_shapes_on_gpu(kind: str, rows: int, context: int):
    """V4-Flash's attention (64 heads of 512, window 128, CSA m = 4 with 64 indexer heads of
    128 and top-512, HCA m' = 128), bf16, block size 64: rows of lengths up to `context`
    (one shorter than the window), the tables `context` wide. The kernels match the torch path
    (a few bf16 ulps: the torch path rounds its scores to bf16), replay in a CUDA graph with
    new positions, and both paths' times are printed."""
    device, dtype, bs = "cuda", torch.bfloat16, 64
    gen = torch.Generator(device=device).manual_seed(0)
    cfg = _cfg(kind, 512, hidden_size=4096, num_attention_heads=64, o_groups=8, head_dim=512,
               sliding_window=128, o_lora_rank=1024, q_lora_rank=1024,
               compress_rates={CSA: 4, HCA: 128}, index_head_dim=128, index_n_heads=64,
               partial_rotary_factor=0.125, max_position_embeddings=1 << 20)
    width = context // bs
    num_blocks = rows * width + 8
    layer = _layer(cfg, dtype, device, num_blocks * bs, gen, bs)
    lengths = torch.randint(context // 2, context, (rows,), generator=gen, device=device)
    lengths[0] = context - 1
    if rows > 1:
        lengths[1] = 100  # shorter than the window
    positions = lengths.tolist()
    ctx = _inputs(layer, rows, dtype, device, gen)

    def make_step() -> StepSpans:
        return _step(positions, width, num_blocks, 0, device,
                     torch.Generator(device=device).manual_seed(3), bs)
    ref, out = _both_paths(layer, ctx, make_step)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

    step = make_step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = layer._attend_decodes_triton(ctx, step)
    step.decode_positions.sub_(7)  # every row 7 tokens back: fewer keys, other entries
    graph.replay()
    layer.use_triton_ops = False
    moved = make_step()
    moved.decode_positions.sub_(7)
    ref_g = layer._attend_decodes(ctx, moved)
    torch.testing.assert_close(out_g.float(), ref_g.float(), atol=2e-2, rtol=2e-2)

    def run_torch(fresh: bool) -> None:
        if fresh:  # (the step's gather indices, built by the first layer of a group)
            step.indices.clear()
        layer._attend_decodes(ctx, step)
    step.decode_positions.add_(7)  # (the torch path at the first positions again)
    torch_fresh, torch_ms = time_ms(lambda: run_torch(True)), time_ms(lambda: run_torch(False))
    layer.use_triton_ops = True
    triton_ms = time_ms(lambda: layer._attend_decodes_triton(ctx, step))
    print(f"\n[{kind} rows={rows} context={context}] torch {torch_ms * 1e3:.0f} us "
          f"({torch_fresh * 1e3:.0f} us building the step's indices), triton "
          f"{triton_ms * 1e3:.0f} us, triton graph replay {time_ms(graph.replay) * 1e3:.0f} us")
    picked, paged = None, layer.entries.decode_pages(step) if layer.entries else None
    if layer.indexer is not None and paged is not None:
        pages = PagedKeys(*paged)
        picked = layer.indexer.pick_rows(ctx.index_q, ctx.index_w, step.decode_positions,
                                         pages, layer.head_dim, bs)
        if picked is not None:
            for block_n in (16, 32, 64):
                for warps in (4, 8):
                    for q_dtype in (torch.float32, dtype):
                        def score(bn: int = block_n, nw: int = warps,
                                  qd: torch.dtype = q_dtype) -> None:
                            index_ops.launch(ctx.index_q.to(qd), ctx.index_w,
                                             step.decode_positions, pages, layer.head_dim, 4,
                                             bs, layer.indexer.scale, block_n=bn,
                                             num_warps=nw)
                        print(f"  index scores q {q_dtype} block_n={block_n} "
                              f"num_warps={warps}: {_timed(score)}")
    for block_n in (16, 32, 64):
        for warps in (4, 8):
            for splits in (None, 1, 4, 16):
                def run(bn: int = block_n, nw: int = warps, ns: int | None = splits) -> None:
                    _launch_attention(layer, ctx, step, picked, bn, nw, ns)
                print(f"  attention block_n={block_n} num_warps={warps} splits="
                      f"{splits or 'auto'}: {_timed(run)}")


def _timed(fn) -> str:
    """fn's time, or why a tiling does not run (more shared memory than the GPU has)."""
    from triton.runtime.errors import OutOfResources

    try:
        return f"{time_ms(fn) * 1e3:.0f} us"
    except OutOfResources as e:
        return f"does not fit ({e})"


def _launch_attention(layer: ca.CompressedAttention, ctx: _StepInputs, step: StepSpans,
                      picked: torch.Tensor | None, block_n: int, num_warps: int,
                      num_splits: int | None) -> torch.Tensor:
    """The attention kernel alone, at one tiling."""
    entries = None
    if layer.entries is not None:
        entries = attn_ops.DecodeEntries(PagedKeys(*layer.entries.decode_pages(step)),
                                         layer.entries.ratio, picked)
    window = PagedKeys(layer.window_rows._rows().view(-1, step.block_size, layer.head_dim),
                       step.decode_tables[0])
    return attn_ops.launch(ctx.q, step.decode_positions, layer.sinks, layer.scale, window,
                           layer.window, step.block_size, entries, block_n=block_n,
                           num_warps=num_warps, num_splits=num_splits)


def test_tiny_engine_with_the_kernels_gives_the_torch_paths_tokens(tiny, monkeypatch):  # noqa: F811
    """The tiny V4 checkpoint of tests/models/test_deepseek_v4.py (window 8, CSA m = 4 with
    top-4, HCA m' = 16), fp32, with the kernels forced on (under the interpreter on the CPU)
    for every decode, alone and beside prefill chunks: the torch path's greedy tokens,
    logprobs within 1e-4 (4.5e-6 seen). Prompts past the window, HCA's group and CSA's top-k
    x m, decoding through closing groups. The chunks stay in torch here (interpreted, their
    rows would take seconds): test_v4_prefill_rows_triton.py runs them through the kernels."""
    from models.test_deepseek_v4 import _prompts

    from shoal import LLM, SamplingParams

    path, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts((6, 19, 41), seed=5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    calls: list[int] = []
    attend = ca.CompressedAttention._attend_decodes_triton

    def counted(self, ctx, step):
        calls.append(step.num_decodes)
        return attend(self, ctx, step)

    def generate() -> list:
        llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
                  num_gpu_blocks_override=128, max_model_len=128)
        try:
            return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    monkeypatch.setattr(ca, "use_triton", lambda x, enabled: False)
    ref = generate()
    monkeypatch.setattr(ca, "use_triton", lambda x, enabled: enabled)
    monkeypatch.setattr(ca.CompressedAttention, "_attend_decodes_triton", counted)
    monkeypatch.setattr(ca.CompressedAttention, "_spans_in_torch",
                        lambda self, q, step: bool(step.spans))  # (the chunks in torch)
    out = generate()
    assert calls and max(calls) >= 3  # (every layer's decodes, the three at once too)
    for got, want in zip(out, ref):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            (tok, lp), = ((t, v.logprob) for t, v in a.items() if t in b)
            assert abs(lp - b[tok].logprob) < 1e-4
