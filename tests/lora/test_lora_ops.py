"""The batched multi-adapter LoRA op (shoal/lora/ops) against a per-token loop: the PyTorch
path and the Triton kernels (the interpreter on the CPU, see conftest.py; compiled on a GPU),
for one to four fused sub-projections of uneven sizes, mixed slots with -1, one slot for
all, no slot at all and no token; split-K partials; rank padding; a CUDA graph replay (GPU
only); refused inputs. These steps are short: the Triton path is its split-K kernels
(lora_split_k.py); test_lora_triton_sgmv.py covers the segmented ones."""

from __future__ import annotations

import pytest
import torch

from shoal.lora.ops import add_lora, lora_torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN, OUT, N_SLOTS = 48, 40, 3
# plain, gate|up-like, q|k|v-like and four-way fusions, with sub-projections of uneven sizes
OFFSETS = [(0,), (0, 24), (0, 16, 28), (0, 8, 20, 28)]
SLOTS = {"mixed": [0, -1, 2, 2, 1, -1, 0], "one_slot": [1] * 5, "decode": [2]}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


def _triton_add_lora():
    pytest.importorskip("triton")
    from shoal.lora.ops import lora_triton

    return lora_triton.add_lora


def _inputs(n_tokens: int, n_sub: int, rank: int, dtype: torch.dtype, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, IN, generator=g)
    y = torch.randn(n_tokens, OUT, generator=g)
    a = torch.randn(N_SLOTS, n_sub * rank, IN, generator=g) * 0.2
    b = torch.randn(N_SLOTS, OUT, rank, generator=g) * 0.2
    return tuple(t.to(DEV, dtype) for t in (y, x, a, b))


def _reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               slots: list[int], offsets: tuple[int, ...], rank: int) -> torch.Tensor:
    """float64, token by token; h rounded to x's dtype as the op documents."""
    out = y.double().clone()
    ends = (*offsets[1:], y.shape[1])
    for t, s in enumerate(slots):
        if s < 0:
            continue
        h = (a[s].double() @ x[t].double()).to(x.dtype).double()
        for i, (lo, hi) in enumerate(zip(offsets, ends)):
            out[t, lo:hi] += b[s, lo:hi].double() @ h[i * rank:(i + 1) * rank]
    return out


def _check(fn, dtype: torch.dtype, offsets: tuple[int, ...], slots: list[int], rank: int) -> None:
    y, x, a, b = _inputs(len(slots), len(offsets), rank, dtype, seed=len(slots) + rank)
    want = _reference(y, x, a, b, slots, offsets, rank)
    fn(y, x, a, b, torch.tensor(slots, dtype=torch.int32, device=DEV), offsets, rank)
    torch.testing.assert_close(y.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
@pytest.mark.parametrize("offsets", OFFSETS, ids=lambda o: f"subs{len(o)}")
@pytest.mark.parametrize("rank", [4, 8])
def test_torch_path(dtype: torch.dtype, slots: list[int], offsets: tuple[int, ...],
                    rank: int) -> None:
    _check(lora_torch.add_lora, dtype, offsets, slots, rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
@pytest.mark.parametrize("offsets", OFFSETS, ids=lambda o: f"subs{len(o)}")
def test_triton_path(dtype: torch.dtype, slots: list[int], offsets: tuple[int, ...]) -> None:
    rank = 8 if len(offsets) == 2 else 4
    _check(_triton_add_lora(), dtype, offsets, slots, rank)


def test_triton_split_k_and_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small blocks: three blocks of rank rows, the input features in three splits of one
    block each (the split-K path's own splits: one program of a token per block of 16)."""
    fn = _triton_add_lora()
    from shoal.lora.ops import lora_split_k

    monkeypatch.setattr(lora_split_k, "shrink_config", lambda *shape: (4, 16, 3, 16))
    for dtype in (torch.float32, torch.bfloat16):
        _check(fn, dtype, (0, 16, 28), SLOTS["mixed"], 4)


def test_triton_split_k_shapes() -> None:
    """The split-K shrink's sizes for the Llama-3.1-8B projections: one step of one token
    spreads A over at least 56 programs of one K block each; longer steps loop over at
    most MAX_ITERS K blocks; no split is empty."""
    pytest.importorskip("triton")
    from shoal.lora.ops import lora_split_k

    for n_rows, in_features in ((48, 4096), (32, 4096), (16, 14336), (16, 4096)):
        for n_tokens in (1, 4, 16, 64):
            block_r, block_k, splits, per = lora_split_k.shrink_config(n_tokens, n_rows,
                                                                       in_features)
            assert per % block_k == 0 and (splits - 1) * per < in_features <= splits * per
            assert per // block_k <= lora_split_k.MAX_ITERS
            assert block_r * block_k <= lora_split_k.TILE
            if n_tokens == 1:
                assert splits >= 56 and per // block_k <= 2
    # rank 512: the expand's [splits, R] tile of partials stays within PARTIALS_TILE
    assert lora_split_k.shrink_config(1, 3 * 512, 4096, 4096 // 512)[2] <= 8


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_adapter_and_no_token_leave_y_alone(backend: str) -> None:
    fn = lora_torch.add_lora if backend == "torch" else _triton_add_lora()
    y, x, a, b = _inputs(4, 2, 4, torch.float32)
    before = y.clone()
    fn(y, x, a, b, torch.full((4,), -1, dtype=torch.int32, device=DEV), (0, 24), 4)
    assert torch.equal(y, before)
    empty = torch.empty(0, OUT, device=DEV)
    fn(empty, x[:0], a, b, torch.empty(0, dtype=torch.int32, device=DEV), (0, 24), 4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rank_padding(backend: str) -> None:
    """A rank-3 adapter zero-padded into R = 4 adds what its unpadded matrices add."""
    fn = lora_torch.add_lora if backend == "torch" else _triton_add_lora()
    g = torch.Generator().manual_seed(7)
    offsets, ends = (0, 16), (16, OUT)
    a3 = [torch.randn(3, IN, generator=g) for _ in offsets]
    b3 = torch.randn(OUT, 3, generator=g)
    x, y = torch.randn(3, IN, generator=g), torch.randn(3, OUT, generator=g)
    a = torch.zeros(N_SLOTS, 8, IN)
    b = torch.zeros(N_SLOTS, OUT, 4)
    a[1, 0:3], a[1, 4:7], b[1, :, :3] = a3[0], a3[1], b3
    want = y.clone()
    for ai, lo, hi in zip(a3, offsets, ends):
        want[:, lo:hi] += (x @ ai.T) @ b3[lo:hi].T
    y, x, a, b = (t.to(DEV) for t in (y, x, a, b))
    fn(y, x, a, b, torch.ones(3, dtype=torch.int32, device=DEV), offsets, 4)
    torch.testing.assert_close(y.cpu(), want, atol=1e-5, rtol=1e-5)


def test_dispatch() -> None:
    y, x, a, b = _inputs(3, 1, 4, torch.float32)
    slots = [0, -1, 2]
    want = _reference(y, x, a, b, slots, (0,), 4)
    add_lora(y, x, a, b, torch.tensor(slots, dtype=torch.int32, device=DEV), (0,), 4,
             use_triton=True)
    torch.testing.assert_close(y.double(), want, **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_path_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed with other slots written into the same tensor."""
    fn = _triton_add_lora()
    offsets = (0, 16, 28)
    y, x, a, b = _inputs(7, 3, 4, torch.bfloat16)
    base = y.clone()
    slots = torch.tensor(SLOTS["mixed"], dtype=torch.int32, device=DEV)
    fn(y, x, a, b, slots, offsets, 4)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(y, x, a, b, slots, offsets, 4)
    for new in ([2, 2, -1, 0, 1, 1, -1], [-1] * 7):
        slots.copy_(torch.tensor(new, dtype=torch.int32))
        y.copy_(base)
        graph.replay()
        want = _reference(base, x, a, b, new, offsets, 4)
        torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inconsistent_shapes_are_refused(backend: str) -> None:
    fn = lora_torch.add_lora if backend == "torch" else _triton_add_lora()
    y, x, a, b = _inputs(2, 2, 4, torch.float32)
    slots = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="a .* must be"):
        fn(y, x[:, :40], a, b, slots, (0, 24), 4)  # in_features of x and a differ
    with pytest.raises(ValueError, match="b .* must be"):
        fn(y, x, a, b[..., :3], slots, (0, 24), 4)  # rank of b differs
    with pytest.raises(ValueError, match="token counts differ"):
        fn(y[:1], x, a, b, slots, (0, 24), 4)
    with pytest.raises(ValueError, match="sub_offsets"):
        fn(y, x, a, b, slots, (0, OUT), 4)
    with pytest.raises(ValueError, match="dtypes differ"):
        fn(y, x, a.bfloat16(), b, slots, (0, 24), 4)


def test_triton_refusals() -> None:
    fn = _triton_add_lora()
    y, x, a, b = _inputs(2, 5, 4, torch.float32)
    slots = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="at most 4"):
        fn(y, x, a, b, slots, (0, 8, 16, 24, 32), 4)
    y, x, a, b = _inputs(2, 1, 4, torch.float32)
    wide = torch.randn(2, 2 * IN, device=DEV)[:, ::2]  # the right shape, strided columns
    with pytest.raises(ValueError, match="x must be contiguous along its last dim"):
        fn(y, wide, a, b, slots, (0,), 4)
    with pytest.raises(ValueError, match="b must be contiguous along its last dim"):
        fn(y, x, a, b.transpose(1, 2).contiguous().transpose(1, 2), slots, (0,), 4)


def test_torch_path_refuses_a_slot_past_the_buffers() -> None:
    y, x, a, b = _inputs(2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="slot 3 out of range"):
        lora_torch.add_lora(y, x, a, b, torch.tensor([3, 0], dtype=torch.int32, device=DEV),
                            (0,), 4)
