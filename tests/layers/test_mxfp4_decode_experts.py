"""The decode path of packed MXFP4 experts (shoal/layers/moe/mxfp4_decode_experts.py) on the
CPU through Triton's interpreter (conftest.py), on tiny shapes: its e2m1 decoding of every
byte; its output against the dequantized weights' PyTorch twin (split and unsplit down
projection, with and without gpt-oss's biases and clamped SwiGLU); launch shapes that do not
depend on the routing (CUDA graphs); and experts_triton_mxfp4's choice of path. bfloat16 runs
on a GPU only: the interpreter truncates casts to bfloat16 (round to nearest on the GPU),
which doubles the error of every rounding."""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from launch_recorder import record_launches  # noqa: E402
from mxfp4_cases import (  # noqa: E402
    ExpertsShape,
    check_against_the_twin,
    check_wide_scales_and_foreign_pairs,
)

import shoal.layers.moe.mxfp4_decode_experts as decode  # noqa: E402
import shoal.layers.moe.triton_experts_mxfp4 as mxfp4_moe  # noqa: E402
from shoal.layers.moe.mxfp4_decode_experts import DecodeTiles, experts_mxfp4_decode  # noqa: E402
from shoal.layers.moe.triton_experts_mxfp4 import (  # noqa: E402
    experts_mxfp4_reference,
    experts_triton_mxfp4,
)
from shoal.layers.quantization.mxfp4 import E2M1_VALUES  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# H = 160 inputs (5 blocks) and I = 96 (3 blocks): every K step of 2 or 4 blocks ends
# part-filled (as gpt-oss's 2880 = 90 blocks does), and gate_up's 96 outputs and down's 160
# end in a partial tile of 64.
E, TOP_K, H, INTER = 4, 2, 160, 96
TILES = {  # (the interpreter's tiles) down split in two / unsplit, other K steps and widths;
    # 4 warps: with 1 the split tile spills on sm_90 (compile_sm90_mxfp4.py)
    "split": DecodeTiles(64, 4, 64, 2, 2),
    "unsplit": DecodeTiles(32, 2, 16, 1, 1),
}


# the shared cases' helpers at this file's shape
SHAPE = ExpertsShape(E, TOP_K, H, INTER, DEV)
packed_experts, routed, biases = SHAPE.packed_experts, SHAPE.routed, SHAPE.biases


@triton.jit
def _decode_bytes(b_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    packed = tl.load(b_ptr + offs).to(tl.int32)
    tl.store(lo_ptr + offs, decode._e2m1_quarter(packed, 0) * 4.0)
    tl.store(hi_ptr + offs, decode._e2m1_quarter(packed, 4) * 4.0)


def test_every_byte_decodes_to_its_two_e2m1_values() -> None:
    """The low nibble is the even element, the high the odd one (mxfp4.py's layout), each
    the format's value exactly (signed zeros compare equal)."""
    b = torch.arange(256, dtype=torch.uint8, device=DEV)
    lo, hi = (torch.empty(256, device=DEV) for _ in range(2))
    _decode_bytes[(1,)](b, lo, hi, N=256)
    lut = torch.tensor(E2M1_VALUES)
    assert torch.equal(lo.cpu(), lut[torch.arange(256) & 15])
    assert torch.equal(hi.cpu(), lut[torch.arange(256) >> 4])


CASES = {  # dtype, gpt-oss's biases and clamped SwiGLU, tiles, tokens
    "fp32-silu-split": (torch.float32, False, "split", 3),
    "fp32-gpt-oss-unsplit": (torch.float32, True, "unsplit", 1),
    "fp32-gpt-oss-split": (torch.float32, True, "split", 2),
    "fp16-gpt-oss-split": (torch.float16, True, "split", 3),
    "bf16-gpt-oss-split": (torch.bfloat16, True, "split", 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_path_matches_the_dequantized_weights(case: str) -> None:
    """check_against_the_twin (tests/mxfp4_cases.py): float32 to 1e-5 of the largest output,
    half precision to four units in the last place in norm."""
    dtype, gpt_oss_mlp, tiles, t = CASES[case]
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the interpreter truncates casts to bfloat16 (the module docstring)")
    check_against_the_twin(functools.partial(experts_mxfp4_decode, tiles=TILES[tiles]), SHAPE, dtype,
                           gpt_oss_mlp, t)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-gate): inf, as on a GPU
def test_wide_scales_and_foreign_pairs_with_weight_zero() -> None:
    """check_wide_scales_and_foreign_pairs (tests/mxfp4_cases.py): scales 2^-27 .. 2^22, and a
    pair of routing weight 0 (another expert-parallel rank's) adding nothing."""
    check_wide_scales_and_foreign_pairs(functools.partial(experts_mxfp4_decode, tiles=TILES["split"]), SHAPE)


def _recording(monkeypatch, launches: list) -> None:
    """Every launch of the decode path's kernels appended as (kernel, grid, argument shapes)."""
    record_launches(monkeypatch, launches, [
        (decode, name) for name in ("_gate_up_kernel", "_down_kernel", "_sum_splits_kernel")])


def test_launch_shapes_do_not_depend_on_the_routing(monkeypatch) -> None:
    """What a CUDA graph needs: the same T and k launch the same three kernels on the same
    grids and buffer shapes whatever the routing (spread over the experts, or all on two)."""
    launches: list = []
    _recording(monkeypatch, launches)
    q = packed_experts(seed=7)
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        x, weights, ids = routed(3, seed=8, ids=ids)
        got = experts_mxfp4_decode(x, q, weights, ids, TILES["split"])
        want = experts_mxfp4_reference(x, q, weights, ids)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert [n for n, *_ in launches] == ["_gate_up_kernel", "_down_kernel",
                                         "_sum_splits_kernel"] * 2
    assert launches[:3] == launches[3:]
    assert launches[0][1] == (3 * TOP_K, 2) and launches[1][1] == (3, 3, 2)


def test_experts_triton_mxfp4_picks_the_decode_path_for_a_few_tokens(monkeypatch) -> None:
    """Untimed on the CPU: the decode path up to MAX_TOKENS rows, the grouped GEMMs above
    them, with a LoRA hook, or when asked for (on a GPU untimed calls take the grouped
    path); an unknown path or a decode path of too many rows is refused. The decode path
    launches gate_up and down, and the sum of down's K splits only when it has several:
    decode_tiles splits I = 96 in two in the interpreter, but not on a GPU (its one K step
    of 4 blocks cannot keep two steps a split)."""
    launches: list = []
    _recording(monkeypatch, launches)
    grouped: list = []
    kernel = mxfp4_moe._mxfp4_grouped_gemm_kernel

    class Grouped:
        def __getitem__(self, grid):
            grouped.append(grid)
            return kernel[grid]

    monkeypatch.setattr(mxfp4_moe, "_mxfp4_grouped_gemm_kernel", Grouped())
    q = packed_experts(seed=9)
    monkeypatch.setattr(mxfp4_moe, "MAX_TOKENS", 2)  # fewer rows to run above it
    x, weights, ids = routed(2, seed=10)
    first = decode.decode_tiles(2, H, INTER, DEV)[0]  # the tiles path="decode" runs
    splits = decode.split_span(INTER, first.down_groups, first.split)[1]
    n = 2 + (splits > 1)
    experts_triton_mxfp4(x, q, weights, ids, path="decode")
    assert [name for name, *_ in launches] == ["_gate_up_kernel", "_down_kernel",
                                               "_sum_splits_kernel"][:n] and not grouped
    assert launches[1][1][2] == splits  # (down's grid: token, H tile, K split)
    if DEV.type != "cuda":  # (on a GPU the choice is the tuner's: launch_tuner.py)
        assert n == 3  # the interpreter runs both down paths (decode_tiles)
        experts_triton_mxfp4(x, q, weights, ids)
        assert len(launches) == 2 * n and not grouped
        launches[n:] = []
    experts_triton_mxfp4(x, q, weights, ids, path="grouped")
    assert len(launches) == n and len(grouped) == 2
    x3, weights3, ids3 = routed(3, seed=11)
    experts_triton_mxfp4(x3, q, weights3, ids3)
    assert len(launches) == n and len(grouped) == 4

    class NoDelta:  # a LoRA hook whose adapters add nothing
        def add(self, *args) -> None:
            pass

    experts_triton_mxfp4(x, q, weights, ids, lora=NoDelta())
    assert len(launches) == n and len(grouped) == 6
    with pytest.raises(ValueError, match="path must be None or one of"):
        experts_triton_mxfp4(x, q, weights, ids, path="gemv")
    with pytest.raises(ValueError, match="takes 1..2 tokens"):
        experts_triton_mxfp4(x3, q, weights3, ids3, path="decode")


def test_decode_tiles_refuse_what_the_kernels_cannot_take() -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        DecodeTiles(48, 4, 32, 4, 1)
    with pytest.raises(ValueError, match=r"split must be in \[1, 64\]"):
        DecodeTiles(32, 4, 32, 4, 0)
