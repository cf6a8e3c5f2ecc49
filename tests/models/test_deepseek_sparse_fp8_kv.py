"""kv_cache_dtype="fp8" for the DeepSeek sparse family on the CPU, fp32, on the tiny random
checkpoints of test_deepseek_v32.py (index_topk 8) and test_deepseek_v4.py (window 8, CSA
m = 4 with top-4, HCA m' = 16):

- exactly the "auto" run whose cached rows are rounded as the FP8 cache stores them: V3.2's
  latent rows with the layer's one scale (kv_quant.py), its indexer keys and V4's window rows
  and compressed entries with a scale per block (fp8_rows.py); V4's compressor inputs of the
  open groups stay in the model dtype. Same tokens, logits within 1e-5 (0.0 measured), in
  mixed chunked batches past top-k, the window and HCA's group, and after a prefix hit: the
  bytes written, the pages' layout and every read (prefill, chunks, decodes) are right. The
  rounding is in place before the engine captures its CUDA graphs, and every row the rounded
  run caches is checked to lie on the FP8 grid (a plain auto run's do not). On CUDA the two
  engines' Triton kernels differ (FP8 tiles and scales loaded and applied in the kernels), so
  there the runs agree up to float32 rounding (greedy_rounding.py): logprobs within
  GPU_LOGPROB_ATOL while they share their context, tokens up to a near tie at that size;
- close to the plain "auto" run, up to near ties (kv_fp8_helpers.py), with margins measured
  on these models (wide: see why below);
- the indexer's top-k moves only where FP8's rounding of the keys can move a score past
  another (the near tie in score space, bounded from the keys' rounding);
- the cache specs' bytes per token: about half of bfloat16's.

Why the margins are wide: these random models turn small changes of their KV rows into large
logit changes. Measured on 8 prompts of 5 to 137 tokens, 16 steps, the first divergence from
the auto run sat at a gap of up to 0.58 (V4) and 0.97 (V3.2) of the row's largest |logit|,
where bfloat16 activations with an "auto" cache (no FP8 at all) needed 0.065 and 0.28; the
top-k choices amplify it (V3.2 with only its indexer keys in FP8 needed 0.67: a pick flipped
at a near tie of the scores changes what attention reads). The exact comparison above carries
the correctness; this one bounds how far FP8 moves these models."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from deepseek_tiny import write_deepseek
from greedy_rounding import assert_same_run_up_to_rounding
from kv_fp8_helpers import compare_with_auto, greedy_run
from models.test_deepseek_v4 import V4, tiny  # noqa: F401 (fixture)
from models.test_deepseek_v32 import V32
from torch import nn
from transformers import AutoConfig

from shoal import LLM
from shoal.attention import kv_quant
from shoal.attention.fp8_rows import BlockScaledRows
from shoal.core.kv_cache_spec import CompressedEntrySpec, context_bytes_per_token
from shoal.layers.compressed_indexer import CompressedIndexer
from shoal.layers.latent_attention import LatentAttention
from shoal.layers.paged_entries import PagedEntries
from shoal.layers.paged_rows import PagedRows
from shoal.layers.sparse_indexer import LightningIndexer
from shoal.worker.kv_cache_tensors import layer_specs

STEPS = 10
# Near ties and mean |logprob difference| against the plain auto run, measured on the prompts
# below (with room): first divergences at up to 0.56 of the largest |logit| (V3.2) and 0.12
# (V4), mean differences 0.87 and 0.25 (the worse of the two batches).
TIE_MARGIN = {"v32": 0.7, "v4": 0.2}
MEAN_LOGPROB_BOUND = {"v32": 1.2, "v4": 0.4}
# On CUDA the FP8 run and the rounded auto run read the same values through different builds
# of the Triton kernels (FP8 tiles converted and scaled in registers: exact at these layers'
# scale 1.0, but q.(k8) s and q.(k8 s) round apart at other scales, and nothing holds a
# build's float32 sums to the other's order). Sums in another order moved this tiny V3.2's
# logprobs by 6.7e-6 (torch against Triton backends, tests/attention/test_mla_sparse.py),
# and a row value pushed across an e4m3 rounding step by them by up to 5.3e-4: 5e-3 leaves
# room for a few such steps. A wrong row or pick moves them by far more: V3.2's decode keys
# left unrounded in the reference (the CUDA failure of 2026-12-06, replayed on the CPU) moved
# them by 0.27 to 4.2 and flipped prompt 2's second token at a gap of 0.24.
GPU_LOGPROB_ATOL = 5e-3


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS = _prompts((5, 30, 61), seed=1)
SHARED = PROMPTS[2][:48]  # a prefix of the third prompt: 12 blocks of 4
AFTER_HIT = [SHARED + [7, 9, 11], SHARED + [300]]


class _RoundedKeys(nn.Module):
    """A V3.2 indexer's rotary embedding whose keys come out as its FP8 cache gives them."""

    def __init__(self, rope: nn.Module, fp8: BlockScaledRows):
        super().__init__()
        self.rope, self.fp8 = rope, fp8

    def forward(self, positions, q, k):
        q, k = self.rope(positions, q, k)
        return q, self.fp8.round_trip(k)


def _rounded_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """An "auto" cache holding what the FP8 one would: latent rows rounded with the layer's
    scale, V4's FP8 rows with their block scales, V3.2's indexer keys by _RoundedKeys. All in
    place before the engine is built: a CUDA graph captured without them would replay its
    steps unrounded (V3.2's decode keys were, when the keys' wrapper came after the engine)."""
    latent_forward, encode = LatentAttention.forward, PagedRows.encode
    indexer_init = LightningIndexer.__init__

    def latent(self, q, rows, *args, **kwargs):
        if not kv_quant.is_fp8(self.kv_cache):
            rows = kv_quant.round_trip(rows, self.kv_scale)
        return latent_forward(self, q, rows, *args, **kwargs)

    def rounded(self, rows):
        if self.fp8_rows is not None and not self.quantized:
            rows = self.fp8_rows.round_trip(rows)
        return encode(self, rows)

    def rounded_keys(self, *args, **kwargs):
        indexer_init(self, *args, **kwargs)
        self.rotary_emb = _RoundedKeys(self.rotary_emb, self.fp8_keys)

    monkeypatch.setattr(LatentAttention, "forward", latent)
    monkeypatch.setattr(PagedRows, "encode", rounded)
    monkeypatch.setattr(LightningIndexer, "__init__", rounded_keys)


def _rows_off_the_fp8_grid(model: nn.Module, block_size: int) -> dict[str, int]:
    """Per kind of layer with FP8 rows, in an "auto" pool: how many of its cached rows a round
    trip through their FP8 form would change (exactly on the CPU; on CUDA by more than 1e-6
    of the row's largest |value|). A rounded run has none; a plain run's rows are off it."""
    off: dict[str, int] = {}
    for layer in model.attention_layers():
        if kv_quant.is_fp8(layer.kv_cache):
            continue
        if isinstance(layer, LatentAttention):
            rows = layer.kv_cache[0, :, 0]
            back = kv_quant.round_trip(rows, layer.kv_scale)
        elif isinstance(layer, LightningIndexer):
            rows = layer.kv_cache[0, :, 0]
            back = layer.fp8_keys.round_trip(rows)
        elif isinstance(layer, PagedRows) and layer.fp8_rows is not None:
            rows = (layer._pages(block_size).flatten(0, 1) if isinstance(layer, PagedEntries)
                    else layer._rows())
            back = layer.fp8_rows.round_trip(rows)
        else:  # (rows kept in the model dtype in an FP8 pool too)
            continue
        tol = 1e-6 * rows.abs().amax(-1) if rows.is_cuda else 0.0
        moved = ((back - rows).abs().amax(-1) > tol).sum()
        name = type(layer).__name__
        off[name] = off.get(name, 0) + int(moved)
    return off


def _runs(path, kv_cache_dtype: str, rounded: bool = False, **engine) -> SimpleNamespace:
    """Greedy runs of PROMPTS, then AFTER_HIT (a prefix hit on the third prompt's blocks)."""
    with pytest.MonkeyPatch.context() as mp:
        if rounded:
            _rounded_rows(mp)
        llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=15,
                  num_gpu_blocks_override=256, max_model_len=256, kv_cache_dtype=kv_cache_dtype,
                  **engine)
        try:
            model = llm.llm_engine.core.runner.model
            first = greedy_run(llm, PROMPTS, STEPS)
            second = greedy_run(llm, AFTER_HIT, STEPS)
            hits = llm.llm_engine.core.scheduler.kv.prefix_hits
            dtypes = {layer.kv_cache.dtype for layer in model.attention_layers()}
            off_grid = _rows_off_the_fp8_grid(model, 4)
        finally:
            llm.shutdown()
    return SimpleNamespace(first=first, second=second, hits=hits, dtypes=dtypes,
                           off_grid=off_grid)


@pytest.fixture(scope="module")
def v32_path(tmp_path_factory):
    return write_deepseek(tmp_path_factory.mktemp("dsv32-fp8"), "deepseek_v32", seed=3,
                          **V32)[0]


@pytest.fixture(scope="module")
def runs(v32_path, tiny):  # noqa: F811
    out = {}
    for name, path in (("v32", v32_path), ("v4", tiny[0])):
        out[name] = {"fp8": _runs(path, "fp8"), "rounded": _runs(path, "auto", rounded=True),
                     "auto": _runs(path, "auto")}
    return out


@pytest.mark.parametrize("model", ["v32", "v4"])
def test_fp8_cache_is_the_auto_run_with_its_rows_rounded(runs, model):
    fp8, rounded = runs[model]["fp8"], runs[model]["rounded"]
    assert fp8.dtypes == {kv_quant.FP8_KV_DTYPE} and rounded.dtypes == {torch.float32}
    assert fp8.hits >= len(SHARED) * 2 and rounded.hits == fp8.hits
    # the reference is what it says: every row it cached is on the FP8 grid, where the plain
    # auto run's rows of every such layer are not (so the check can fail)
    plain = runs[model]["auto"].off_grid
    assert plain and all(plain.values()), plain
    assert rounded.off_grid == dict.fromkeys(plain, 0), rounded.off_grid
    for part, got, want in (("first", fp8.first, rounded.first),
                            ("second", fp8.second, rounded.second)):
        if got.logits[0][0].is_cuda:  # (the Triton kernels: up to float32 rounding)
            agreed = assert_same_run_up_to_rounding(got, want, GPU_LOGPROB_ATOL,
                                                    f"{model} {part} batch, fp8 vs rounded:")
            print(f"{model} {part} batch, fp8 vs rounded: {agreed.describe()}")
            continue
        assert got.tokens == want.tokens
        for a, b in zip(got.logits, want.logits):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", ["v32", "v4"])
def test_fp8_cache_stays_close_to_the_auto_run(runs, model):
    fp8, auto = runs[model]["fp8"], runs[model]["auto"]
    for got, want in ((fp8.first, auto.first), (fp8.second, auto.second)):
        cmp = compare_with_auto(got, want, TIE_MARGIN[model])
        print(f"{model}: {cmp.describe()}")
        assert cmp.mean_abs_logprob_diff < MEAN_LOGPROB_BOUND[model], cmp.describe()


def _score_bound(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rounded: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """How far rounding the keys may move each query's score of each key [n, S]: relu is
    1-Lipschitz, so |delta| <= scale * sum_h |w_h| |q_h . (k' - k)|."""
    moved = torch.einsum("nhd,sd->nhs", q, rounded - keys).abs()
    return scale * torch.einsum("nh,nhs->ns", w.abs(), moved)


@pytest.mark.parametrize("which", ["v32", "v4"])
def test_indexer_picks_change_only_at_near_ties(which):
    """Random queries, head weights and keys of several sizes: the top-k picked over keys
    read back from FP8 differs from the exact keys' only where two exact scores lie within
    the rounding's bound of each other (and FP8 does flip some picks here: the check bites)."""
    gen = torch.Generator().manual_seed(4)
    if which == "v32":
        cfg = AutoConfig.for_model("deepseek_v32", **V32)
        indexer = LightningIndexer(cfg, torch.float32)
        fp8 = indexer.fp8_keys
    else:
        cfg = SimpleNamespace(**V4)
        indexer = CompressedIndexer(cfg, 4, None, torch.float32)
        fp8 = BlockScaledRows.of((indexer.head_dim, 128))
    n, s, h, d, k = 64, 48, indexer.n_heads, indexer.head_dim, 8
    q = torch.randn(n, h, d, generator=gen)
    w = torch.randn(n, h, generator=gen)
    keys = torch.randn(s, d, generator=gen) * torch.rand(s, 1, generator=gen).mul(6).exp2()
    rounded = fp8.round_trip(keys)
    visible = torch.ones(n, s, dtype=torch.bool)
    if which == "v32":
        exact, got = (indexer._scores(q, x, w) for x in (keys, rounded))
    else:
        exact, got = (indexer.scores(q, w, x, visible) for x in (keys, rounded))
    bound = _score_bound(q, w, keys, rounded, indexer.scale)
    picked = exact.topk(k, -1).indices
    flips = 0
    for i in range(n):
        mine, theirs = set(got[i].topk(k).indices.tolist()), set(picked[i].tolist())
        for a in theirs - mine:  # dropped for b: exact a >= b, but rounding put b above
            for b in mine - theirs:
                assert exact[i, a] - exact[i, b] <= bound[i, a] + bound[i, b] + 1e-5
        flips += len(theirs - mine)
    assert 0 < flips < n  # (a few, at near ties)


def test_kv_bytes_per_token_are_about_half_of_bfloat16s():
    """The cache specs at V3.2's and V4-Flash's head dims (small hidden sizes): each FP8 row
    costs its values plus 4 bytes a block's scale, V4's open groups' inputs keep bfloat16."""
    fp8, bf16 = kv_quant.FP8_KV_DTYPE, torch.bfloat16
    from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM
    from shoal.models.deepseek_v32 import DeepseekV32ForCausalLM

    v32 = DeepseekV32ForCausalLM(AutoConfig.for_model(
        "deepseek_v32", **dict(V32, num_hidden_layers=1, first_k_dense_replace=1,
                               kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)), bf16)
    row = {dt: [s.head_size * s.dtype_bytes for s in layer_specs(v32.attention_layers(), dt)]
           for dt in (bf16, fp8)}
    assert row[bf16] == [2 * 576, 2 * 128]  # latent, indexer key
    assert row[fp8] == [576, 128 + 4 + 12]  # one scale per 128 values of the key, padding
    v4 = DeepseekV4ForCausalLM(AutoConfig.for_model(
        "deepseek_v4", **dict(V4, head_dim=512, index_head_dim=128, partial_rotary_factor=0.125,
                              compress_rates={"compressed_sparse_attention": 4,
                                              "heavily_compressed_attention": 128})), bf16)
    specs = {dt: layer_specs(v4.attention_layers(), dt) for dt in (bf16, fp8)}
    # layer 1 (CSA): window, entries (key + index key), open groups' inputs
    csa = [(s.head_size * s.dtype_bytes) for s in specs[fp8][1:4]]
    assert csa == [512 + 4 * 8, 512 + 128 + 4 * (8 + 1) + 12,  # (rows: multiples of 16)
                   specs[bf16][3].head_size * specs[bf16][3].dtype_bytes]
    assert specs[bf16][1].head_size * 2 == 1024 and specs[bf16][2].head_size * 2 == 1280
    assert all(isinstance(s, CompressedEntrySpec) for s in (specs[fp8][2], specs[fp8][5]))
    ratio = context_bytes_per_token(specs[fp8], 16) / context_bytes_per_token(specs[bf16], 16)
    assert ratio == pytest.approx((2 * 688 / 4 + 544 / 128) / (2 * 1280 / 4 + 1024 / 128))
    assert 0.5 < ratio < 0.55


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_fp8_decode_graphs_give_the_eager_torch_paths_tokens(tiny):  # noqa: F811
    """On CUDA, fp32: the tiny V4 with an FP8 cache through its Triton decode kernels in
    CUDA graphs gives the eager torch path's greedy run (the same FP8 pages, dequantized in
    torch) up to float32 rounding (greedy_rounding.py): logprobs within 1e-3 while the runs
    share their context, the same tokens up to a near tie at that size (the two paths sum in
    different orders, so rows can cross an e4m3 rounding step apart)."""
    params = dict(dtype="float32", block_size=4, max_num_batched_tokens=15,
                  num_gpu_blocks_override=256, max_model_len=256, kv_cache_dtype="fp8")
    outs = []
    for extra in ({}, {"enforce_eager": True, "use_triton_ops": False}):
        llm = LLM(model=str(tiny[0]), **params, **extra)
        try:
            outs.append(greedy_run(llm, PROMPTS + AFTER_HIT, STEPS))
        finally:
            llm.shutdown()
    graphs, eager = outs
    agreed = assert_same_run_up_to_rounding(graphs, eager, 1e-3, "v4 graphs vs eager torch:")
    print(f"v4 graphs vs eager torch: {agreed.describe()}")


def test_the_compatibility_table_takes_fp8_for_both():
    """No row refuses kv_cache_dtype='fp8' for V3.2 (either backend: CUDA's default is the
    Triton one) or for V4 (blocks of 16, CPU or CUDA); V4 with blocks not a multiple of 4 on
    CUDA is refused (tests/engine/test_compatibility.py holds its message)."""
    from shoal.engine.compatibility import ResolvedArgs, violations
    from shoal.engine.engine_args import EngineArgs

    v32 = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                          kv_lora_rank=32, index_topk=8, num_hidden_layers=2)
    v4 = SimpleNamespace(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                         index_topk=512, num_hidden_layers=2)

    def rows(hf, device, **kw):
        args = EngineArgs(kv_cache_dtype="fp8", **kw)
        return [r.other for r in violations(ResolvedArgs(args, "generate", device, 64, hf))]
    assert rows(v32, "cpu") == rows(v32, "cuda", attention_backend="torch") == []
    assert rows(v32, "cuda") == rows(v32, "cuda", block_size=2) == []  # (4-byte rows)
    assert rows(v4, "cpu") == rows(v4, "cuda") == rows(v4, "cpu", block_size=6) == []
    assert rows(v4, "cuda", block_size=6) == [
        "kv_cache_dtype='fp8' with a block_size not a multiple of 4 on CUDA"]
