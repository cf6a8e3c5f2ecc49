"""The MLA (multi-head latent attention) Triton kernels vs a plain PyTorch reference, run on
the CPU through the Triton interpreter (see conftest.py; compiled on a GPU).

Shapes are tiny (v_dim 32/64, rope_dim 16) but the tile sizes are the GPU ones, so ragged
key tiles, block boundaries, head blocks padded past H, split-K and padded rows are
exercised as on the device."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.ops.mla_cache_write import write_mla_cache  # noqa: E402
from shoal.attention.ops.mla_decode import choose_num_splits, mla_paged_decode  # noqa: E402
from shoal.attention.ops.mla_prefill import mla_paged_prefill, prefill_config  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
BF16_DOT = pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot does not support "
                              "bf16 (triton-lang/triton#11584); runs on a GPU")
ROPE = 16
BS = 16


def make_cache(seq_lens: list[int], dk: int, dtype: torch.dtype, gen: torch.Generator,
               width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A randomly filled cache (garbage in unused slots too) and block tables laid out over a
    random permutation of its blocks; table entries past a request's blocks are 0."""
    need = [-(-n // BS) for n in seq_lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen).tolist()
    width = width or max(max(need), 1)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    i = 0
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    cache = torch.randn(nb * BS, dk, generator=gen).to(DEV, dtype)
    return cache, tables.to(DEV)


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
              seq_lens: list[int], query_lens: list[int], scale: float,
              v_dim: int) -> list[torch.Tensor]:
    """Per request [q_len, H, v_dim] in fp32: gather the latents through the block table,
    causal fp32 softmax. q holds the requests' queries back to back."""
    outs, start = [], 0
    for n, ql, table in zip(seq_lens, query_lens, tables.cpu()):
        pos = torch.arange(n)
        slots = (table.long()[pos // BS] * BS + pos % BS).to(cache.device)
        lat = cache[slots].float()  # [n, Dk]
        qr = q[start:start + ql].float()  # [ql, H, Dk]
        s = torch.einsum("thd,nd->thn", qr, lat) * scale
        q_pos = n - ql + torch.arange(ql)
        causal = (pos[None, :] <= q_pos[:, None]).to(cache.device)
        s = s.masked_fill(~causal[:, None, :], float("-inf"))
        outs.append(torch.einsum("thn,nd->thd", torch.softmax(s, -1), lat[:, :v_dim]))
        start += ql
    return outs


def run_decode(seq_lens: list[int], h: int, v_dim: int, *, dtype: torch.dtype = torch.float32,
               num_splits: int | None = None, seed: int = 0, strided_q: bool = False,
               width: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dk = v_dim + ROPE
    cache, tables = make_cache(seq_lens, dk, dtype, gen, width)
    b = len(seq_lens)
    if strided_q:  # q as a view: heads interleaved with other data, batch stride padded
        q = torch.randn(b, h, 2 * dk + 8, generator=gen).to(DEV, dtype)[:, :, 8:8 + dk]
    else:
        q = torch.randn(b, h, dk, generator=gen).to(DEV, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(dk)
    before = cache.clone()
    out = mla_paged_decode(q, cache, tables, lens, BS, scale, v_dim, num_splits=num_splits)
    assert out.shape == (b, h, v_dim) and out.dtype == dtype
    assert torch.equal(cache, before)
    tol = TOL[dtype]
    real = [i for i, n in enumerate(seq_lens) if n > 0]
    ref = reference(q[real], cache, tables[real], [seq_lens[i] for i in real], [1] * len(real),
                    scale, v_dim)
    for i, r in zip(real, ref):
        torch.testing.assert_close(out[i].float(), r[0], atol=tol, rtol=tol)
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert torch.all(out[i] == 0), "padded rows must be zero"
    return out


RAGGED = [1, 16, 17, 45, 100]  # one key, a block's end, one past it, ragged tiles


@pytest.mark.parametrize("h", [1, 3, 16, 20])
def test_decode_heads_no_split(h: int) -> None:
    run_decode(RAGGED, h, 32, num_splits=1, seed=h)


@pytest.mark.parametrize("splits", [None, 3])
def test_decode_split_k(splits: int | None) -> None:
    # None: the heuristic picks splits > 1 (B * head blocks far below the SM count); 3 does
    # not divide the tiles evenly and leaves the short sequences' later splits empty.
    assert choose_num_splits(3, 20, 130) > 1
    run_decode([130, 5, 33], 20, 64, num_splits=splits, seed=11)


def test_decode_fixed_splits_padded_rows_strided_q() -> None:
    # CUDA-graph style: fixed num_splits, fixed table width, seq_len-0 padding rows.
    run_decode([40, 0, 7, 0], 3, 32, num_splits=4, seed=12, strided_q=True, width=8)
    run_decode([0, 0], 16, 32, num_splits=1, seed=13)


def test_decode_out_argument() -> None:
    gen = torch.Generator().manual_seed(14)
    cache, tables = make_cache([20, 3], 48, torch.float32, gen)
    q = torch.randn(2, 4, 48, generator=gen).to(DEV)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=DEV)
    out = torch.full((2, 4, 32), 7.0, device=DEV)
    got = mla_paged_decode(q, cache, tables, lens, BS, 0.1, 32, out=out, num_splits=2)
    assert got is out
    ref = reference(q, cache, tables, [20, 3], [1, 1], 0.1, 32)
    torch.testing.assert_close(out[:, None], torch.stack(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_DOT), torch.float16])
def test_decode_half_precision(dtype: torch.dtype) -> None:
    run_decode([70, 9], 16, 64, dtype=dtype, num_splits=2, seed=15)


def run_prefill(ctx: list[int], qlens: list[int], h: int, v_dim: int, *,
                dtype: torch.dtype = torch.float32, first_row: int = 0, seed: int = 0,
                pad_tokens: int = 0) -> None:
    """Requests r >= first_row have qlens[r] new tokens after ctx[r] cached ones. Rows of q
    belonging to requests before first_row, and pad_tokens rows after all, must be left as
    they were in out."""
    gen = torch.Generator().manual_seed(seed)
    dk = v_dim + ROPE
    seq_lens = [c + n for c, n in zip(ctx, qlens)]
    cache, tables = make_cache(seq_lens, dk, dtype, gen)
    t = sum(qlens) + pad_tokens
    q = torch.randn(t, h, dk, generator=gen).to(DEV, dtype)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(dk)
    out = torch.full((t, h, v_dim), 3.0, device=DEV, dtype=dtype)
    got = mla_paged_prefill(q, cache, tables, lens, qsl, max(qlens[first_row:]), BS, scale,
                            v_dim, out=out, first_row=first_row)
    assert got is out
    start = sum(qlens[:first_row])
    ref = reference(q[start:], cache, tables[first_row:], seq_lens[first_row:],
                    qlens[first_row:], scale, v_dim)
    tol = TOL[dtype]
    torch.testing.assert_close(out[start:start + sum(qlens[first_row:])].float(),
                               torch.cat(ref), atol=tol, rtol=tol)
    untouched = torch.cat([out[:start], out[sum(qlens):]])
    assert torch.all(untouched == 3.0), "rows outside the requests' queries were written"


@pytest.mark.parametrize("h", [1, 3, 16, 20])
def test_prefill_without_context(h: int) -> None:
    run_prefill([0, 0], [19, 1], h, 32, seed=20 + h)


def test_prefill_chunks_after_context_first_row() -> None:
    # Two decode-like rows skipped via first_row; then a chunk after context that ends on a
    # block boundary, a one-token chunk after a long context, and a first chunk.
    run_prefill([9, 30, 16, 37, 0], [1, 1, 16, 1, 21], 3, 32, first_row=2, seed=31,
                pad_tokens=2)


def test_prefill_long_context_several_tiles() -> None:
    # 130 cached keys: whole unmasked key tiles before the diagonal; 37 queries over H = 16
    # span several query tiles of BLOCK_Q tokens.
    run_prefill([130, 5], [37, 3], 16, 64, seed=32)


@pytest.mark.parametrize("sms", [0, 4096])
def test_prefill_short_tiles_heuristic(sms: int, monkeypatch) -> None:
    from shoal.attention.ops import mla_prefill as mp

    monkeypatch.setattr(mp, "_num_sms", lambda device: sms)
    run_prefill([50], [12], 4, 32, seed=33 + sms)


def test_many_head_blocks() -> None:
    # DeepSeek-V3's 128 heads: 8 head blocks per sequence, in decode (with splits) and prefill.
    run_decode([50, 3], 128, 32, num_splits=2, seed=35)
    run_prefill([18, 0], [3, 5], 128, 32, seed=36)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_DOT), torch.float16])
def test_prefill_half_precision(dtype: torch.dtype) -> None:
    run_prefill([20, 0], [9, 14], 16, 64, dtype=dtype, seed=34)


def test_prefill_config_tiles() -> None:
    # DeepSeek shapes: 16-head blocks, 64-row tiles for a prompt, 16 rows for one token.
    assert prefill_config(128, 4096, 1, torch.bfloat16, 512) == (16, 64, 32, 8, 1)
    assert prefill_config(16, 1, 1, torch.bfloat16, 512)[1] == 16
    assert prefill_config(1, 100, 1, torch.float32, 32)[:2] == (1, 64)
    # 4 query tiles x 1 head block are far too few for 132 SMs: tiles shrink to 16 rows.
    assert prefill_config(16, 16, 1, torch.bfloat16, 512, num_sms=132)[1] == 16


def test_choose_num_splits() -> None:
    assert choose_num_splits(64, 16, 4096) == 4  # 64 programs: two waves want 5 -> 4
    assert choose_num_splits(1, 16, 512) == 4  # limited by MIN_SPLIT_TOKENS
    assert choose_num_splits(1, 16, 32768) == 64  # capped at MAX_SPLITS
    assert choose_num_splits(8, 128, 32768) == 4  # 64 programs
    assert choose_num_splits(1, 16, 0) == 1


def test_wrappers_reject_bad_inputs() -> None:
    q = torch.randn(2, 4, 48, device=DEV)
    cache = torch.zeros(32, 48, device=DEV)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    lens = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="int32"):
        mla_paged_decode(q, cache, bt.long(), lens, BS, 0.1, 32)
    with pytest.raises(ValueError, match="power of two"):
        mla_paged_decode(q, cache, bt, lens, BS, 0.1, 24)
    with pytest.raises(ValueError, match="fit"):
        mla_paged_decode(q, cache[:, :40], bt, lens, BS, 0.1, 32)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        mla_paged_decode(q.half(), cache, bt, lens, BS, 0.1, 32)
    with pytest.raises(ValueError, match="contiguous"):
        mla_paged_decode(q.transpose(0, 2).contiguous().transpose(0, 2), cache, bt, lens, BS,
                         0.1, 32)
    with pytest.raises(ValueError, match="out"):
        mla_paged_decode(q, cache, bt, lens, BS, 0.1, 32, out=torch.empty(2, 4, 48, device=DEV))
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="query_start_loc"):
        mla_paged_prefill(q, cache, bt, lens, qsl.long(), 1, BS, 0.1, 32)
    with pytest.raises(ValueError, match="first_row"):
        mla_paged_prefill(q, cache, bt, lens, qsl, 1, BS, 0.1, 32, first_row=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_cache_write_strided_and_padding_slots(dtype: torch.dtype, kernel: bool,
                                               monkeypatch) -> None:
    if not kernel and DEV.type == "cuda":
        pytest.skip("CUDA tensors always take the kernel")
    if not kernel:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    elif DEV.type == "cpu" and not INTERPRET:
        pytest.skip("the kernel needs a GPU or the interpreter")
    gen = torch.Generator().manual_seed(40)
    t, dk = 5, 80  # 64 + 16: not a power of two
    fused = torch.randn(t, dk + 24, generator=gen).to(DEV, dtype)  # latent: a strided view
    latent = fused[:, 24:]
    cache = torch.randn(48, dk, generator=gen).to(DEV, dtype)
    for slot_dtype in (torch.int64, torch.int32):
        slots = torch.tensor([7, -1, 0, 47, -1], dtype=slot_dtype, device=DEV)
        expect = cache.clone()
        ok = slots >= 0
        expect[slots[ok].long()] = latent[ok]
        write_mla_cache(latent, cache, slots)
        assert torch.equal(cache, expect)
    with pytest.raises(ValueError, match="fit"):
        write_mla_cache(latent[:, :64], cache, slots)


def test_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/mla_decode_gpu.py --smoke: the timing script's whole path at a tiny size."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_decode_gpu.py"
    spec = importlib.util.spec_from_file_location("mla_decode_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "mla.json"
    rows = mod.main(["--smoke", "--out", str(out)])
    assert out.exists() and rows
    for row in rows:
        assert row["absorbed_ms"] > 0 and row["max_abs_err"] < 5e-2
