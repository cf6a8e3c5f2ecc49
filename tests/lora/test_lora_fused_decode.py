"""The fused decode path of the Triton LoRA op (lora_fused_decode.py) against the split-K path
and the PyTorch path: one to three tokens with -1 slots mixed in, one to three
sub-projections of uneven sizes, row blocks crossing the q|k|v boundaries and programs of
several blocks with a masked tail, input features not a multiple of the K tile, ranks 8 and
16 (and 6: padded); the tuner's dispatch between the two; on a GPU, Llama-3.1-8B's
projections timed in CUDA graphs. The interpreter on the CPU (conftest.py).

Tolerances as test_lora_triton_sgmv.py's: float32 to 1e-5 (summation order only); bfloat16
against the PyTorch path atol 2^-6, rtol 2^-7 (it rounds the delta before adding it to y).
With exact operands (small multiples of powers of two: every float32 sum exact in any
order) the fused and split-K paths both give y + B round(A x) rounded once, bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch

from shoal.layers.quantization import launch_tuner
from shoal.lora.ops import lora_torch

pytest.importorskip("triton")
from shoal.lora.ops import lora_fused_decode, lora_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN, OUT, N_SLOTS = 80, 45, 3
OFFSETS = [(0,), (0, 30), (0, 20, 30)]  # plain, gate|up-like, q|k|v-like: uneven sizes
SLOTS = {1: [2], 2: [-1, 1], 3: [1, -1, 0]}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=2 ** -6, rtol=2 ** -7)}
# (block_k, block_n, chunks): 16-row blocks crossing q|k (20) and k|v (30), two or three
# blocks a program (the last program's tail masked), a K tile leaving a masked tail of 80
CONFIGS = {"default": None, "k16_n16": (16, 16, 1), "k32_n16x2": (32, 16, 2),
           "k64_n16x3": (64, 16, 3)}


def _inputs(n_tokens: int, n_sub: int, rank: int, dtype: torch.dtype, seed: int,
            exact: bool = False) -> tuple[torch.Tensor, ...]:
    """y, x, a, b. exact: x integers in [-3, 3], A multiples of 2^-6 below 2^-2, B and y
    multiples of 2^-4 and 2^-6 below 2: A x and B h are exact in float32 (and h's bfloat16
    rounding stays on the 2^-6 grid), so the only rounding is of h and of y + delta."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        x = torch.randint(-3, 4, (n_tokens, IN), generator=g).float()
        a = torch.randint(-15, 16, (N_SLOTS, n_sub * rank, IN), generator=g) / 64
        b = torch.randint(-31, 32, (N_SLOTS, OUT, rank), generator=g) / 16
        y = torch.randint(-127, 128, (n_tokens, OUT), generator=g) / 64
    else:  # |h| < 1, B of 0.5: deltas of about 0.2 (as test_lora_triton_sgmv.py)
        x = torch.randn(n_tokens, IN, generator=g)
        a = torch.randn(N_SLOTS, n_sub * rank, IN, generator=g) * 0.025
        b = torch.randn(N_SLOTS, OUT, rank, generator=g) * 0.5
        y = torch.randn(n_tokens, OUT, generator=g)
    return tuple(t.to(DEV, dtype) for t in (y, x, a, b))


def _config(monkeypatch: pytest.MonkeyPatch, name: str, rank: int) -> None:
    if CONFIGS[name] is not None:
        block_k, block_n, chunks = CONFIGS[name]
        cfg = lora_fused_decode.FusedConfig(block_k, block_n, chunks, 1 << (rank - 1).bit_length())
        monkeypatch.setattr(lora_fused_decode, "fused_config", lambda *shape: cfg)


def _run(path: str, y: torch.Tensor, *args) -> torch.Tensor:
    out = y.clone()
    lora_triton.add_lora(out, *args, path=path)
    return out


# (tokens, sub-projections, rank, config): each count, fusion, rank and config several times
CASES = [(1, 1, 8, "default"), (1, 3, 16, "k16_n16"), (2, 2, 16, "k32_n16x2"),
         (2, 3, 8, "k64_n16x3"), (3, 3, 16, "k32_n16x2"), (3, 2, 8, "k16_n16"),
         (3, 1, 16, "k64_n16x3"), (2, 3, 16, "default")]


@pytest.mark.parametrize("n_tokens,n_sub,rank,config", CASES,
                         ids=lambda v: str(v))
def test_fused_matches_split_k_and_torch(n_tokens: int, n_sub: int, rank: int, config: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and bfloat16 random operands; y is added to, and slot -1 rows stay as they were."""
    offsets = OFFSETS[n_sub - 1]
    _config(monkeypatch, config, rank)
    slots = torch.tensor(SLOTS[n_tokens], dtype=torch.int32, device=DEV)
    for dtype in (torch.float32, torch.bfloat16):
        y, x, a, b = _inputs(n_tokens, len(offsets), rank, dtype, seed=n_tokens * 10 + rank)
        args = (x, a, b, slots, offsets, rank)
        fused, split_k = _run("fused", y, *args), _run("split_k", y, *args)
        want = y.clone()
        lora_torch.add_lora(want, *args)
        torch.testing.assert_close(fused.float(), want.float(), **TOL[dtype])
        torch.testing.assert_close(fused.float(), split_k.float(), **TOL[dtype])
        none = slots < 0
        assert torch.equal(fused[none], y[none])
        assert not torch.equal(fused[~none], y[~none])  # the delta did land


@pytest.mark.parametrize("config", ["default", "k32_n16x2"])
@pytest.mark.parametrize("rank", [6, 16])
def test_exact_operands_bit_for_bit(config: str, rank: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every float32 sum is exact, fused == split-K == y + B round(A x) rounded once
    (float64 reference), bit for bit, in bfloat16 and float32; rank 6 pads to 8."""
    _config(monkeypatch, config, rank)
    offsets = OFFSETS[2]
    slots_list = SLOTS[3]
    slots = torch.tensor(slots_list, dtype=torch.int32, device=DEV)
    for dtype in (torch.bfloat16, torch.float32):
        y, x, a, b = _inputs(3, 3, rank, dtype, seed=rank, exact=True)
        args = (x, a, b, slots, offsets, rank)
        fused, split_k = _run("fused", y, *args), _run("split_k", y, *args)
        want = y.double().clone()
        ends = (*offsets[1:], OUT)
        for t, s in enumerate(slots_list):
            if s >= 0:
                h = (a[s].double() @ x[t].double()).to(dtype).double()
                for i, (lo, hi) in enumerate(zip(offsets, ends)):
                    want[t, lo:hi] += b[s, lo:hi].double() @ h[i * rank:(i + 1) * rank]
        assert torch.equal(fused, split_k)
        assert torch.equal(fused, want.to(dtype))


def test_default_configs() -> None:
    """Tiles within 16 elements a thread; a token's programs near PROGRAM_TARGET at most;
    Llama-3.1-8B gate|up (28,672 rows) at rank 16 in 56 programs of two 256-row blocks."""
    for n_tokens in (1, 2, 4):
        for out, k, rank in ((6144, 4096, 16), (28672, 4096, 16), (4096, 14336, 8),
                             (45, 80, 6), (4096, 4096, 64)):
            cfg = lora_fused_decode.fused_config(n_tokens, out, k, rank)
            assert cfg.r_pad * cfg.block_k <= lora_fused_decode.TILE
            assert cfg.r_pad * cfg.block_n <= lora_fused_decode.TILE
            programs = -(-out // cfg.rows_per_program)
            assert programs <= max(1, lora_fused_decode.PROGRAM_TARGET // n_tokens)
            assert (cfg.chunks - 1) * cfg.block_n < -(-out // programs)  # no idle block
    cfg = lora_fused_decode.fused_config(1, 28672, 4096, 16)
    assert (cfg.block_k, cfg.block_n, cfg.chunks) == (256, 256, 2)


def test_dispatch_takes_the_tuned_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_path: a timed key's choice; an untimed one with tuning off is split-K and
    stays untimed. On the CPU add_lora never asks (choose_path's split-K, bit for bit)."""
    y, x, a, b = _inputs(2, 3, 8, torch.float32, seed=7)
    starts = lora_triton.starts_of([(0, 20), (20, 30), (30, OUT)], OUT)
    assert starts == [20, 30, OUT]
    key = lora_triton.decode_key(y, x, a, 3, 8)
    monkeypatch.setitem(launch_tuner.TUNED, key, launch_tuner.Tuned("fused"))
    assert lora_triton.decode_path(y, x, a, b, starts, 3, 8) == "fused"
    monkeypatch.delitem(launch_tuner.TUNED, key)
    monkeypatch.setenv("SHOAL_QUANT_TUNING", "0")
    assert lora_triton.decode_path(y, x, a, b, starts, 3, 8) == "split_k"
    assert key not in launch_tuner.TUNED
    if DEV.type == "cpu":
        slots = torch.tensor([0, 2], dtype=torch.int32)
        args = (x, a, b, slots, OFFSETS[2], 8)
        assert torch.equal(_run(None, y, *args), _run("split_k", y, *args))


def test_bad_path_is_refused() -> None:
    y, x, a, b = _inputs(1, 1, 8, torch.float32, seed=8)
    with pytest.raises(ValueError, match="path must be one of"):
        lora_triton.add_lora(y, x, a, b, torch.zeros(1, dtype=torch.int32, device=DEV), (0,),
                             8, path="fused_decode")


# Llama-3.1-8B's adapted projections: (in, out, sub-projection offsets)
LLAMA_8B = {"qkv": (4096, 6144, (0, 4096, 5120)), "o": (4096, 4096, (0,)),
            "gate_up": (4096, 28672, (0, 14336)), "down": (14336, 4096, (0,))}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama_8b_shapes_timed_in_cuda_graphs() -> None:
    """Rank 16, bf16, 4 slots: split-K and fused timed in CUDA graphs (launch_tuner
    .gpu_time_us), their results agreeing; add_lora's own pick (tuned on its first call)
    gives that path's result and replays in a graph. Prints the figures and a decode step's
    total (32 layers)."""
    rank, n_slots = 16, 4
    per_step = {"split_k": 0.0, "fused": 0.0, "auto": 0.0}
    for n_tokens in (1, 2, 4):
        for name, (k, out, offsets) in LLAMA_8B.items():
            g = torch.Generator(device="cuda").manual_seed(n_tokens)
            dev = dict(device="cuda", generator=g)
            x = torch.randn(n_tokens, k, **dev).bfloat16()
            y = torch.randn(n_tokens, out, **dev).bfloat16()
            a = (torch.randn(n_slots, len(offsets) * rank, k, **dev) * k ** -0.5).bfloat16()
            b = (torch.randn(n_slots, out, rank, **dev) * 0.5).bfloat16()
            slots = torch.tensor([2, 0, 3, 1][:n_tokens], dtype=torch.int32, device="cuda")
            args = (x, a, b, slots, offsets, rank)
            split_k, fused = _run("split_k", y, *args), _run("fused", y, *args)
            torch.testing.assert_close(fused.float(), split_k.float(), **TOL[torch.bfloat16])
            times = {}
            for path in ("split_k", "fused"):
                times[path] = launch_tuner.gpu_time_us(
                    functools.partial(lora_triton.add_lora, y.clone(), *args, path=path))
            auto = _run(None, y, *args)  # tunes this key (outside any capture)
            choice = launch_tuner.TUNED[lora_triton.decode_key(y, x, a, len(offsets),
                                                               rank)].choice
            assert torch.equal(auto, fused if choice == "fused" else split_k)
            work = y.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                lora_triton.add_lora(work, *args)
            work.copy_(y)
            graph.replay()
            assert torch.equal(work, auto)
            print(f"T={n_tokens} {name:8s} in={k} out={out}: split_k {times['split_k']:.2f} us, "
                  f"fused {times['fused']:.2f} us ({times['split_k'] / times['fused']:.2f}x); "
                  f"tuned pick {choice}")
            if n_tokens == 1:
                for path in ("split_k", "fused"):
                    per_step[path] += 32 * times[path]
                per_step["auto"] += 32 * times[choice]
    print("T=1 decode step, 32 layers x 4 projections: " + ", ".join(
        f"{p} {us / 1e3:.3f} ms" for p, us in per_step.items()))
