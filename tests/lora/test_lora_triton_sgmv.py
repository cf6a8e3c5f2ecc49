"""The segmented (SGMV) path of the Triton LoRA op, and the choice between it and split-K,
against the PyTorch path (lora_torch.add_lora): random slots with -1 and repeats, q|k|v
sub-projections of unequal sizes, token counts around the threshold and across segment
blocks, a rank below the buffers' padded rank, split-K partials summed over several rounds,
planning passes over several chunks of token_slots, and slots past the buffers. The
interpreter on the CPU (conftest.py), compiled on a GPU; a CUDA graph replay on a GPU only.

Tolerances: float32 matches to 1e-5 (the paths differ only in summation order). In bfloat16
both round y to nearest even (attention/ops/interpreted_half.py makes the interpreter round
as a GPU does), but the PyTorch path rounds the delta B h to bfloat16 before adding it to y,
where the kernels add in float32 and round once: up to half an ulp of y each (2^-8 |y|: rtol
2^-7 covers both) and half an ulp of the delta. Both round h = A x to bfloat16 from float32
sums taken in different orders; where h's last bit flips, the delta moves by |B| ulp(h) <= 2
* 2^-8 (the inputs keep |h| < 1 and |B| < 2): atol 2^-6 covers it and the delta's rounding."""

from __future__ import annotations

import pytest
import torch

from shoal.lora.ops import lora_torch

pytest.importorskip("triton")
from shoal.lora.ops import lora_segmented, lora_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN, OUT, N_SLOTS, R = 80, 40, 3, 6  # R: not a power of two (padded to 16 in the expand)
QKV = (0, 16, 28)  # q|k|v-like, of 16, 12 and 12 rows
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=2 ** -6, rtol=2 ** -7)}


def _inputs(n_tokens: int, offsets: tuple[int, ...], dtype: torch.dtype, seed: int,
            rank: int = R, n_slots: int = N_SLOTS) -> tuple[torch.Tensor, ...]:
    """y, x, a, b and random slots in [-1, n_slots); each adapter of rank 4 zero-padded to
    R rows of A and R columns of B, as the slot buffers hold a lower-rank adapter. h = A x
    has a standard deviation of 0.22 (|h| < 1), B of 0.5: deltas of about 0.2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, IN, generator=g)
    y = torch.randn(n_tokens, OUT, generator=g)
    a = torch.randn(n_slots, len(offsets) * rank, IN, generator=g) * 0.025
    b = torch.randn(n_slots, OUT, rank, generator=g) * 0.5
    for i in range(len(offsets)):
        a[:, i * rank + 4:(i + 1) * rank] = 0
    b[:, :, 4:] = 0
    slots = torch.randint(-1, n_slots, (n_tokens,), generator=g, dtype=torch.int32)
    return (*(t.to(DEV, dtype) for t in (y, x, a, b)), slots.to(DEV))


def _check(n_tokens: int, offsets: tuple[int, ...], dtype: torch.dtype, path: str | None,
           seed: int = 0, slots: list[int] | None = None) -> torch.Tensor:
    y, x, a, b, token_slots = _inputs(n_tokens, offsets, dtype, seed)
    if slots is not None:
        token_slots = torch.tensor(slots, dtype=torch.int32, device=DEV)
    want = y.clone()
    lora_torch.add_lora(want, x, a, b, token_slots, offsets, R)
    got = y.clone()
    lora_triton.add_lora(got, x, a, b, token_slots, offsets, R, path=path)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    none = token_slots < 0
    assert torch.equal(got[none], y[none])  # tokens of no adapter: untouched
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens", [1, 17, 70])
def test_segmented_matches_torch(n_tokens: int, dtype: torch.dtype) -> None:
    """One token; one full segment block and a partial one; several blocks per slot."""
    _check(n_tokens, QKV, dtype, "segmented", seed=n_tokens)


def test_segmented_single_projection_and_one_slot() -> None:
    _check(40, (0,), torch.float32, "segmented", seed=1)
    _check(40, QKV, torch.float32, "segmented", slots=[2] * 40)  # a prefill of one adapter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threshold", [None, 8], ids=["default", "moved"])
def test_threshold_picks_the_path(dtype: torch.dtype, threshold: int | None,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Around SEGMENTED_MIN_TOKENS (the default, and moved as the benchmark moves it), the
    automatic choice agrees with the torch path and is the named path's result, bit for
    bit."""
    if threshold is not None:
        monkeypatch.setattr(lora_triton, "SEGMENTED_MIN_TOKENS", threshold)
    t0 = lora_triton.SEGMENTED_MIN_TOKENS
    for n_tokens in (t0 - 1, t0, t0 + 1):
        path = lora_triton.choose_path(n_tokens, N_SLOTS, len(QKV), R)
        assert path == ("segmented" if n_tokens >= t0 else "split_k")
        auto = _check(n_tokens, QKV, dtype, None, seed=n_tokens)
        named = _check(n_tokens, QKV, dtype, path, seed=n_tokens)
        assert torch.equal(auto, named)
    assert lora_triton.choose_path(4096, lora_segmented.MAX_SLOTS + 1, 1, 16) == "split_k"
    assert lora_triton.choose_path(4096, 16, 3, 128) == "split_k"  # h too wide for its tiles


def test_splits_and_planning_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small K blocks: five split-K partials, summed by the expand in two rounds of four;
    small chunks: the planning passes run over several chunks of token_slots."""
    monkeypatch.setattr(lora_segmented, "BLOCK_K", 16)
    monkeypatch.setattr(lora_segmented, "MIN_CHUNK", 16)
    monkeypatch.setattr(lora_segmented, "SCAN_CHUNK", 16)
    lora_segmented.plan.cache_clear()
    try:
        c = lora_segmented.plan(45, N_SLOTS, 3, R, IN, OUT)
        assert c.splits == 5 and c.scan_chunk == 16
        for dtype in (torch.float32, torch.bfloat16):
            _check(45, QKV, dtype, "segmented", seed=3)
    finally:
        lora_segmented.plan.cache_clear()


def test_slots_past_the_buffers_are_skipped() -> None:
    """The segmented path counts a slot >= S as no adapter (it cannot raise without a
    sync); the rows of the valid slots are still right. int64 slots, as MoE expert LoRA
    passes them."""
    slots = [0, 3, 1, 7, 2, -1] * 6
    y, x, a, b, _ = _inputs(len(slots), QKV, torch.float32, seed=4)
    token_slots = torch.tensor(slots, dtype=torch.int64, device=DEV)
    got = y.clone()
    lora_triton.add_lora(got, x, a, b, token_slots, QKV, R, path="segmented")
    valid = torch.where(token_slots < N_SLOTS, token_slots, -1)
    want = y.clone()
    lora_torch.add_lora(want, x, a, b, valid, QKV, R)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[valid < 0], y[valid < 0])


def test_path_refusals() -> None:
    y, x, a, b, slots = _inputs(4, (0,), torch.float32, seed=5)
    with pytest.raises(ValueError, match="path must be"):
        lora_triton.add_lora(y, x, a, b, slots, (0,), R, path="sgmv")
    many = a.new_zeros(lora_segmented.MAX_SLOTS + 1, *a.shape[1:])
    with pytest.raises(ValueError, match="at most 64 slots and ranks up to 64"):
        lora_triton.add_lora(y, x, many, b.new_zeros(many.shape[0], *b.shape[1:]), slots,
                             (0,), R, path="segmented")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_segmented_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed with other slots (other segments) in the same tensor."""
    y, x, a, b, slots = _inputs(70, QKV, torch.bfloat16, seed=6)
    base = y.clone()
    lora_triton.add_lora(y, x, a, b, slots, QKV, R, path="segmented")  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_triton.add_lora(y, x, a, b, slots, QKV, R, path="segmented")
    for new in ([2] * 70, [-1] * 70, [i % 4 - 1 for i in range(70)]):
        slots.copy_(torch.tensor(new, dtype=torch.int32))
        y.copy_(base)
        graph.replay()
        want = base.clone()
        lora_torch.add_lora(want, x, a, b, slots, QKV, R)
        torch.testing.assert_close(y.float(), want.float(), **TOL[torch.bfloat16])
