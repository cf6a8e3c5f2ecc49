"""The C++ CPU paged decode kernel against the SDPA reference of paged_attention (the same
step through both paths) and a dense float64 attention. Builds the kernel if the Makefile's
set-up has not; skips only where this machine has no toolchain to build it with."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from shoal import cpu_kernels
from shoal.attention.metadata import AttentionMetadata, build_attention_metadata
from shoal.attention.ops import cpu_paged_decode as kernel
from shoal.attention.torch_backend import paged_attention

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    missing = cpu_kernels.missing_toolchain()
    if missing:
        pytest.skip(f"cannot build the CPU decode kernel here: {missing}")
    cpu_kernels.build()  # a compile error fails the tests: the toolchain is there
    kernel.unavailable_reason.cache_clear()
    assert kernel.available()


def decode_step(lens: list[int], hq: int, hk: int, d: int, bs: int, dtype: torch.dtype,
                window: int | None = None, seed: int = 0):
    """One decode step of len(lens) sequences, sequence i at lens[i] tokens (its new token
    included), blocks scattered at random over a cache of finite garbage. Returns the step's
    q, k, v, cache, metadata and each sequence's full keys and values."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
    cache = torch.randn(2, num_blocks * bs, hk, d, generator=gen).to(dtype)
    ks = [torch.randn(n, hk, d, generator=gen).to(dtype) for n in lens]
    vs = [torch.randn(n, hk, d, generator=gen).to(dtype) for n in lens]
    for n, t, k, v in zip(lens, tables, ks, vs):
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n - 1)], dtype=torch.long)
        cache[0, slots], cache[1, slots] = k[:n - 1], v[:n - 1]
    md = build_attention_metadata(
        query_lens=[1] * len(lens), context_lens=[n - 1 for n in lens], block_tables=tables,
        block_size=bs, num_decodes=len(lens), sliding_window=window, device=CPU,
        null_block=perm[-1])
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    k_new = torch.stack([k[-1] for k in ks])
    v_new = torch.stack([v[-1] for v in vs])
    return q, k_new, v_new, cache, md, ks, vs


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          window: int | None) -> torch.Tensor:
    """q [Hq, D] at the last of k's positions; k, v [L, Hk, D]; float64 [Hq, D]."""
    g = q.shape[0] // k.shape[1]
    if window is not None:
        k, v = k[-window:], v[-window:]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    p = (torch.einsum("hd,khd->hk", q.double(), kk) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", p, vv)


def both_paths(q, k, v, cache, md: AttentionMetadata, scale: float):
    ref = paged_attention(q, k, v, cache.clone(), md, scale, decode_kernel=False)
    got = paged_attention(q, k, v, cache, md, scale)
    return got, ref


CASES = [  # batch lengths (not multiples of the block size), heads, head dim, block size
    pytest.param([37], 9, 3, 64, 16, id="b1-smollm2"),
    pytest.param([1, 16, 17, 600, 33], 9, 3, 64, 16, id="b5-smollm2"),
    pytest.param([5, 90, 3, 47, 200, 1, 64, 129], 4, 4, 128, 16, id="b8-mha-d128"),
    pytest.param([70, 11, 300], 12, 4, 128, 5, id="b3-bs5-d128"),
    pytest.param([23, 41], 6, 2, 40, 8, id="b2-d40"),
    pytest.param([2 * i + 1 for i in range(40)], 9, 3, 64, 16, id="b40"),
]


@pytest.mark.parametrize(("lens", "hq", "hk", "d", "bs"), CASES)
def test_float32_matches_the_reference_tightly(lens, hq, hk, d, bs) -> None:
    q, k, v, cache, md, ks, vs = decode_step(lens, hq, hk, d, bs, torch.float32)
    scale = 1.0 / math.sqrt(d)
    got, ref = both_paths(q, k, v, cache, md, scale)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    for i in range(len(lens)):
        torch.testing.assert_close(got[i].double(), dense(q[i], ks[i], vs[i], scale, None),
                                   atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("lens", "hq", "hk", "d", "bs"), CASES)
def test_bfloat16_matches_the_reference_loosely(lens, hq, hk, d, bs) -> None:
    q, k, v, cache, md, ks, vs = decode_step(lens, hq, hk, d, bs, torch.bfloat16, seed=1)
    scale = 1.0 / math.sqrt(d)
    got, ref = both_paths(q, k, v, cache, md, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
    for i in range(len(lens)):  # fp32 accumulation: within bf16 rounding of the exact value
        torch.testing.assert_close(got[i].double(), dense(q[i], ks[i], vs[i], scale, None),
                                   atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [1, 7, 16, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window: int, dtype: torch.dtype) -> None:
    lens = [1, 5, 16, 17, 40, 130]
    q, k, v, cache, md, ks, vs = decode_step(lens, 9, 3, 64, 16, dtype, window, seed=2)
    got, ref = both_paths(q, k, v, cache, md, 0.125)
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol * 5)
    for i in range(len(lens)):
        torch.testing.assert_close(got[i].double(), dense(q[i], ks[i], vs[i], 0.125, window),
                                   atol=tol, rtol=tol * 5)


def test_strided_q_empty_rows_and_thread_counts() -> None:
    """q as a slice of a fused qkv row (the model's layout), a padding row of length 0 (zeros),
    and the same bits with one thread as with two."""
    q, _, _, cache, md, ks, vs = decode_step([9, 1, 33], 9, 3, 64, 16, torch.float32, seed=3)
    qkv = torch.zeros(3, 15, 64)
    qkv[:, :9] = q
    seq_lens = torch.tensor([8, 0, 32], dtype=torch.long)  # the cached keys (no new token)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.full((3, 9, 64), float("nan"))
            kernel.cpu_paged_decode(out, qkv[:, :9], cache, md.decode_block_tables, seq_lens,
                                    16, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][1], torch.zeros(9, 64))
    for i in (0, 2):
        torch.testing.assert_close(outs[0][i].double(),
                                   dense(q[i], ks[i][:-1], vs[i][:-1], 0.125, None),
                                   atol=2e-6, rtol=1e-5)


def test_fits_only_the_contract() -> None:
    cache = torch.zeros(2, 32, 3, 64)
    assert kernel.fits(torch.zeros(4, 9, 64), cache)
    assert not kernel.fits(torch.zeros(4, 9, 64, dtype=torch.float16), cache.half())
    assert not kernel.fits(torch.zeros(4, 9, 64, dtype=torch.bfloat16), cache)  # mixed dtypes
    assert not kernel.fits(torch.zeros(4, 51, 64), torch.zeros(2, 32, 3, 64))  # 51 % 3
    assert not kernel.fits(torch.zeros(4, 17, 64), torch.zeros(2, 32, 1, 64))  # group 17
    assert not kernel.fits(torch.zeros(4, 2, 512), torch.zeros(2, 32, 1, 512))  # head dim


def test_missing_build_falls_back_and_says_why_once(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("SHOAL_EXTENSIONS_DIR", str(tmp_path))
    kernel.unavailable_reason.cache_clear()
    cpu_kernels.unavailable_reason.cache_clear()
    cpu_kernels._fingerprint.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            q, k, v, cache, md, _, _ = decode_step([20, 3], 9, 3, 64, 16, torch.float32)
            got, ref = both_paths(q, k, v, cache, md, 0.125)
            paged_attention(q, k, v, cache, md, 0.125)
        assert torch.equal(got, ref)  # both took the SDPA path
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 1 and "--build" in msgs[0] and str(tmp_path) in msgs[0]
    finally:
        monkeypatch.undo()
        kernel.unavailable_reason.cache_clear()
        cpu_kernels.unavailable_reason.cache_clear()
    assert kernel.available()


def test_bad_tables_raise_instead_of_reading_out_of_bounds() -> None:
    cache = torch.zeros(2, 4 * 16, 3, 64)  # 4 blocks
    q = torch.zeros(2, 9, 64)
    out = torch.empty_like(q)
    tables = torch.tensor([[0, 1], [2, 3]])
    kernel.cpu_paged_decode(out, q, cache, tables, torch.tensor([20, 32]), 16, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.cpu_paged_decode(out, q, cache, torch.tensor([[0, 1], [2, 4]]),
                                torch.tensor([20, 32]), 16, 0.125)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernel.cpu_paged_decode(out, q, cache, tables, torch.tensor([20, 33]), 16, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.cpu_paged_decode(out.half(), q.half(), cache.half(), tables,
                                torch.tensor([20, 32]), 16, 0.125)
