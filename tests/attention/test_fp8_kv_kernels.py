"""The FP8 KV cache (kv_cache_dtype="fp8"): the quantization itself (saturation, scale,
rounding), the torch reference backend against attention over the dequantized values, the
C++ CPU decode kernel's gate, and each Triton kernel (KV write, fused rope + KV write, paged
decode and prefill, MLA write / decode / prefill) against the torch reference, in the
interpreter on the CPU (see conftest.py; compiled on a GPU).

Under the interpreter tl.dot has no bf16 (see test_triton_kernels.py): the kernels run with
fp32 and fp16 activations there; bf16 runs on a GPU."""

from __future__ import annotations

import os
import random

import pytest
import torch
from e4m3_edge_values import e4m3_edge_values

pytest.importorskip("triton")

from shoal.attention import kv_quant  # noqa: E402
from shoal.attention.metadata import build_attention_metadata  # noqa: E402
from shoal.attention.ops import cpu_paged_decode as cpu_kernel  # noqa: E402
from shoal.attention.ops.kv_cache_write import write_kv_cache  # noqa: E402
from shoal.attention.ops.mla_cache_write import write_mla_cache  # noqa: E402
from shoal.attention.ops.paged_decode import paged_decode  # noqa: E402
from shoal.attention.ops.rope_kv_write import (  # noqa: E402
    rope_kv_write,
    rope_kv_write_reference,
)
from shoal.attention.torch_backend import (  # noqa: E402
    TorchAttentionBackend,
    paged_attention,
)
from shoal.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    build_triton_attention_metadata,
    paged_attention_triton,
)
from shoal.layers.attention import Attention  # noqa: E402
from shoal.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter's tl.dot has no bf16; runs on a GPU"))]


def fp8_randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Finite FP8 garbage, as a cache holds before a step writes."""
    return kv_quant.quantize(torch.randn(*shape, generator=gen) * 2, scale).to(DEV)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """FP8 caches written alike: bit for bit in the interpreter; on a GPU within one FP8 step
    (its float32 norm and rotation may round an input an ulp apart)."""
    if INTERPRET or not a.is_cuda:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.allclose(a.float(), b.float(), rtol=2.0 ** -3, atol=2.0 ** -9)


# ---- the quantization --------------------------------------------------------------------
def test_quantize_saturates_divides_by_the_scale_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1000.0, -1000.0, 896.0, 17.0, 18.0, 0.3, 0.0, float("nan")])
    got = kv_quant.quantize(x, 2.0).float()
    # /2: 500 and -500 saturate at +-448 (a plain cast would give NaN); 448 stays; 8.5 is a
    # tie between 8 and 9 (3 mantissa bits: 8, 9, 10...) and rounds to even 8; 9; 0.15 to
    # its nearest e4m3 value; zero; NaN stays NaN.
    assert got[:6].tolist() == [448.0, -448.0, 448.0, 8.0, 9.0, 0.15625]
    assert got[6] == 0 and got[7].isnan()
    back = kv_quant.dequantize(kv_quant.quantize(x[:6], 2.0), 2.0, torch.float32)
    assert back.tolist() == [896.0, -896.0, 896.0, 16.0, 18.0, 0.3125]


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_round_trip_error_is_half_an_fp8_step(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 4 * scale
    err = (kv_quant.round_trip(x, scale) - x).abs()
    normal = x.abs() / scale >= 2.0 ** -6  # e4m3's smallest normal
    assert torch.all(err[normal] <= x.abs()[normal] * 2.0 ** -4 + 1e-12)
    assert torch.all(err[~normal] <= scale * 2.0 ** -10)  # subnormal steps: 2^-9
    assert kv_quant.round_trip(x.bfloat16(), scale).dtype == torch.bfloat16


def test_bad_scales_are_refused() -> None:
    layer = Attention(4, 2, 16)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="k_scale must be a finite scale"):
            layer.set_kv_scales(bad, None)
    layer.set_kv_scales(None, 0.5)
    assert (layer.k_scale, layer.v_scale) == (1.0, 0.5)


# ---- the torch reference backend ---------------------------------------------------------
def random_step(seqs: list[tuple[int, int]], hq: int, hk: int, d: int, bs: int, seed: int,
                dtype: torch.dtype = torch.float32):
    """(ctx, q) per request: block tables over a shuffled pool, the null block last, q/k/v."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // bs) for c, q in seqs]
    nb = sum(need) + 2
    free = list(range(nb))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    t = sum(q for _, q in seqs)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(DEV, dtype) for h in (hq, hk, hk))
    cache = fp8_randn(2, (nb + 1) * bs, hk, d, gen=gen)
    cache[:, nb * bs:] = 0  # the null block
    kw = dict(query_lens=[q for _, q in seqs], context_lens=[c for c, _ in seqs],
              block_tables=tables, block_size=bs, sliding_window=None, device=DEV)
    return q, k, v, cache, kw, nb


MIXED = [(9, 1), (0, 1), (7, 1), (11, 5), (0, 12), (3, 5), (8, 1)]  # 3 decodes, then chunks


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 3.0)])
def test_torch_backend_attends_the_dequantized_cache(scales: tuple[float, float]) -> None:
    """An FP8 step equals a float32 step over a cache holding the dequantized values, with
    the step's own k and v as they come back from FP8 (fresh prompts included)."""
    ks, vs = scales
    q, k, v, cache, kw, nb = random_step(MIXED, 8, 2, 32, 4, seed=1)
    md = build_attention_metadata(**kw, num_decodes=3, null_block=nb)
    dense = torch.stack([kv_quant.dequantize(cache[0], ks, torch.float32),
                         kv_quant.dequantize(cache[1], vs, torch.float32)])
    out = paged_attention(q, k, v, cache, md, 0.2, k_scale=ks, v_scale=vs)
    ref = paged_attention(q, kv_quant.round_trip(k, ks), kv_quant.round_trip(v, vs), dense, md,
                          0.2, decode_kernel=False)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert cache.dtype == FP8
    torch.testing.assert_close(kv_quant.dequantize(cache[0], ks, torch.float32), dense[0])
    torch.testing.assert_close(kv_quant.dequantize(cache[1], vs, torch.float32), dense[1])


def test_cpu_decode_kernel_leaves_fp8_caches_to_the_torch_path() -> None:
    q = torch.randn(2, 4, 32)
    assert cpu_kernel.fits(q, torch.zeros(2, 16, 2, 32))
    assert not cpu_kernel.fits(q, torch.zeros(2, 16, 2, 32, dtype=FP8))


def test_layer_passes_its_scales_only_for_an_fp8_cache() -> None:
    seen: list[dict] = []

    class Recording(TorchAttentionBackend):
        def forward(self, *args, **kw):
            seen.append(kw)
            return super().forward(*args, **kw)

    class NoFP8(TorchAttentionBackend):
        name = "nofp8"
        supports_fp8_kv_cache = False

    layer = Attention(4, 2, 16)
    layer.set_kv_scales(0.5, 2.0)
    q, k, v, cache, kw, nb = random_step([(0, 3)], 4, 2, 16, 4, seed=2)
    md = build_attention_metadata(**kw, num_decodes=0, null_block=nb)
    layer.backend = Recording()
    for kv in (cache, torch.zeros(cache.shape, device=DEV)):
        layer.kv_cache = kv
        layer(q, k, v, md)
    assert seen == [{"k_scale": 0.5, "v_scale": 2.0}, {}]
    layer.backend, layer.kv_cache = NoFP8(), cache
    with pytest.raises(NotImplementedError, match="no FP8 KV cache"):
        layer(q, k, v, md)


# ---- Triton kernels against the reference ------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_quantizes_with_the_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    t, hk, d = 5, 2, 32
    qkv = (torch.randn(t, 4 * hk * d, generator=gen) * 300).to(DEV, dtype)  # some saturate
    k = qkv[:, :hk * d].view(t, hk, d)  # strided views of a fused projection
    v = qkv[:, 2 * hk * d:3 * hk * d].view(t, hk, d)
    slots = torch.tensor([3, -1, 0, 17, 9], device=DEV)  # -1: a padding row
    cache = fp8_randn(2, 20, hk, d, gen=gen)
    ref = cache.clone()
    write_kv_cache(cache, k, v, slots, 0.5, 4.0)
    ok = slots >= 0
    ref[0, slots[ok]] = kv_quant.quantize(k[ok], 0.5)
    ref[1, slots[ok]] = kv_quant.quantize(v[ok], 4.0)
    assert same_bytes(cache, ref)
    assert cache[0].float().abs().max() == kv_quant.FP8_MAX


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp8_writes_are_torchs_cast_byte_for_byte_at_e4m3s_edges(scale: float) -> None:
    """The KV and MLA cache writes (ops/fp8.py's to_fp8, which builds each e4m3 byte in
    integer arithmetic) give kv_quant.quantize's bytes, on every device (no same_bytes
    leeway): negative values that round to -0 (0x80; an H100's float cast wrote +0),
    subnormals and their ties, ties between normals (to even, carrying into the exponent),
    saturation at 448 (0x7E), inf, NaN (tests/e4m3_edge_values.py). Scale 0.37 moves the
    ties an ulp or so, as a checkpoint's scale does. In the interpreter this checks the
    integer construction; the GPU's own division and add are checked only on a GPU."""
    x = e4m3_edge_values() * scale
    d = 32
    x = torch.cat([x, x.new_zeros(-x.numel() % (2 * d))]).to(DEV)
    want = kv_quant.quantize(x, scale).view(torch.uint8).view(-1, d)
    latent = torch.empty(want.shape, dtype=FP8, device=DEV)
    write_mla_cache(x.view(-1, d), latent, torch.arange(len(want), device=DEV), scale)
    assert torch.equal(latent.view(torch.uint8), want)
    kv = x.view(-1, 2, 1, d)  # k and v: each token's two rows, with its own scale each
    cache = torch.zeros(2, len(kv), 1, d, dtype=FP8, device=DEV)
    write_kv_cache(cache, kv[:, 0], kv[:, 1], torch.arange(len(kv), device=DEV), scale,
                   scale * 2)
    assert torch.equal(cache[0].view(torch.uint8).view(-1, d), want[0::2])
    assert torch.equal(cache[1].view(torch.uint8).view(-1, d),
                       kv_quant.quantize(kv[:, 1], scale * 2).view(torch.uint8).view(-1, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_write_quantizes_the_rotated_key(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    t, hq, hk, d, bs = 4, 4, 2, 64, 8
    rope = RotaryEmbedding(d, 64, 10000.0).to(DEV)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(DEV, dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    w = (torch.randn(d, generator=gen) * 0.5 + 1).to(DEV, dtype)
    positions = torch.tensor([0, 7, 8, 30], device=DEV)
    slots = torch.tensor([7, -1, 8, 0], device=DEV)
    cache = fp8_randn(2, 3 * bs, hk, d, gen=gen)
    ref_q, ref_cache = q.clone(), cache.clone()
    rope_kv_write_reference(positions, ref_q, k, v, rope.cos_sin_cache, ref_cache, slots,
                            w, w, 1e-6, k_scale=0.25, v_scale=2.0)
    rope_kv_write(positions, q, k, v, rope.cos_sin_cache, cache, slots, w, w, 1e-6,
                  k_scale=0.25, v_scale=2.0)
    torch.testing.assert_close(q, ref_q, atol=TOL[dtype], rtol=TOL[dtype])
    assert same_bytes(cache, ref_cache)


def run_fp8_step(seqs: list[tuple[int, int]], num_decodes: int, hq: int, hk: int, d: int,
                 bs: int, dtype: torch.dtype, scales: tuple[float, float], seed: int,
                 num_splits: int | None = None, sinks: bool = False) -> None:
    """paged_attention_triton on an FP8 cache against the torch backend (float32 activations
    of the same values) on a copy: same cache bytes, outputs within the dtype's tolerance."""
    q, k, v, cache, kw, nb = random_step(seqs, hq, hk, d, bs, seed, dtype)
    ks, vs = scales
    sk = torch.randn(hq, generator=torch.Generator().manual_seed(seed)).to(DEV) if sinks else None
    ref_cache = cache.clone()
    md = build_attention_metadata(**kw, num_decodes=num_decodes, null_block=nb)
    ref = paged_attention(q.float(), k.float(), v.float(), ref_cache, md, d ** -0.5,
                          sinks=sk, k_scale=ks, v_scale=vs)
    tmd = build_triton_attention_metadata(**kw, num_decodes=num_decodes,
                                          decode_num_splits=num_splits)
    out = paged_attention_triton(q, k, v, cache, tmd, d ** -0.5, sk, ks, vs)
    assert out.dtype == dtype and same_bytes(cache, ref_cache)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_and_prefill_read_fp8(dtype: torch.dtype) -> None:
    run_fp8_step(MIXED, 3, 8, 2, 32, 4, dtype, (0.5, 2.0), seed=5)


def test_split_k_decode_with_sinks_reads_fp8() -> None:
    # Split outputs are scaled before the reduce; a sink adds nothing to the value.
    run_fp8_step([(130, 1), (5, 1), (0, 9)], 2, 4, 2, 32, 16, torch.float32, (2.0, 0.125),
                 seed=6, num_splits=4, sinks=True)


def test_triton_backend_fused_forward_takes_the_scales() -> None:
    """forward_fused (rope + norm + write, then attention) against the torch backend fed the
    rotated keys: one FP8 cache semantics on both."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, cache, kw, nb = random_step([(6, 1), (0, 5)], 4, 2, 32, 4, seed=7)
    rope = RotaryEmbedding(32, 64, 10000.0).to(DEV)
    positions = torch.tensor([6, 0, 1, 2, 3, 4], device=DEV)
    w = (torch.randn(32, generator=gen) * 0.3 + 1).to(DEV)
    backend = TritonAttentionBackend()
    tmd = backend.build_metadata(**kw, num_decodes=1, null_block=nb)
    ref_q, tmp = q.clone(), torch.zeros(2, 6, 2, 32, device=DEV)
    rope_kv_write_reference(positions, ref_q, k, v, rope.cos_sin_cache, tmp,
                            torch.arange(6, device=DEV), w, w, 1e-6)  # tmp[0]: rotated keys
    ref_cache = cache.clone()
    out = backend.forward_fused(q, k, v, positions, rope.cos_sin_cache, w, w, 1e-6, cache, tmd,
                                0.2, k_scale=0.5, v_scale=1.5)
    md = build_attention_metadata(**kw, num_decodes=1, null_block=nb)
    ref = paged_attention(ref_q, tmp[0], v, ref_cache, md, 0.2, k_scale=0.5, v_scale=1.5)
    assert same_bytes(cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_decode_wrapper_checks_the_fp8_cache() -> None:
    gen = torch.Generator().manual_seed(8)
    cache = fp8_randn(2, 16, 2, 32, gen=gen)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    lens = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        paged_decode(torch.zeros(1, 4, 32, dtype=FP8, device=DEV), cache, bt, lens, 4, 1.0)
    with pytest.raises(ValueError, match="dtype|fp16"):
        paged_decode(torch.zeros(1, 4, 32, device=DEV), cache.float().half(), bt, lens, 4, 1.0)


# ---- latent attention (MLA) --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_kernels_read_and_write_fp8(dtype: torch.dtype) -> None:
    v_dim, rope_dim, bs, heads = 32, 16, 4, 3
    seqs = [(5, 1), (17, 1), (0, 6), (9, 4)]
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    free = list(range(40))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // bs))] for c, q in seqs]
    cache = fp8_randn(1, 41 * bs, 1, v_dim + rope_dim, gen=gen, scale=0.5)
    cache[:, 40 * bs:] = 0
    t = sum(q for _, q in seqs)
    q = torch.randn(t, heads, v_dim + rope_dim, generator=gen).to(DEV, dtype)
    latent = (torch.randn(t, v_dim + rope_dim, generator=gen) * 3).to(DEV, dtype)
    kw = dict(query_lens=[q for _, q in seqs], context_lens=[c for c, _ in seqs],
              block_tables=tables, block_size=bs, num_decodes=2, sliding_window=None,
              device=DEV, null_block=40)
    scale = (v_dim + rope_dim) ** -0.5
    ref_cache = cache.clone()
    torch_be, triton_be = TorchAttentionBackend(), TritonAttentionBackend()
    ref = torch_be.forward_mla(q.float(), latent.float(), ref_cache, torch_be.build_metadata(**kw),
                               scale, v_dim, kv_scale=0.5)
    out = triton_be.forward_mla(q, latent, cache, triton_be.build_metadata(**kw), scale, v_dim,
                                kv_scale=0.5)
    assert same_bytes(cache, ref_cache)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_mla_torch_reference_attends_the_dequantized_rows() -> None:
    v_dim, bs = 32, 4
    gen = torch.Generator().manual_seed(10)
    cache = fp8_randn(1, 9 * bs, 1, v_dim + 16, gen=gen)
    cache[:, 8 * bs:] = 0
    q = torch.randn(4, 2, v_dim + 16, generator=gen).to(DEV)
    latent = torch.randn(4, v_dim + 16, generator=gen).to(DEV)
    kw = dict(query_lens=[1, 3], context_lens=[6, 2], block_tables=[[3, 5], [0, 1]],
              block_size=bs, num_decodes=1, sliding_window=None, device=DEV, null_block=8)
    be = TorchAttentionBackend()
    dense = kv_quant.dequantize(cache, 2.0, torch.float32)
    out = be.forward_mla(q, latent, cache, be.build_metadata(**kw), 0.1, v_dim, kv_scale=2.0)
    ref = be.forward_mla(q, kv_quant.round_trip(latent, 2.0), dense, be.build_metadata(**kw),
                         0.1, v_dim)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_warmup_compiles_the_fp8_variants_with_the_model_dtype() -> None:
    """The warmup's dummy queries take the activations' dtype, not the cache's (an FP8 query
    is refused by the kernels)."""
    gen = torch.Generator().manual_seed(11)
    backend = TritonAttentionBackend()
    cache = fp8_randn(2, 4 * 16, 2, 32, gen=gen)
    assert backend.warm_kernels(cache, 4, 0.2, 16, None, q_dtype=torch.float32) > 0
    latent = fp8_randn(1, 4 * 16, 1, 48, gen=gen)
    assert backend.warm_mla_kernels(latent, 4, 0.2, 16, 32, q_dtype=torch.float32) > 0
