"""The word kernels of packed MXFP4 experts at decode sizes (shoal/layers/moe/
mxfp4_decode_words.py) on the CPU through Triton's interpreter (conftest.py), on tiny
shapes: the decoding of every e2m1 code in every position of a 4-byte word; the output
against the dequantized weights' PyTorch twin (K in a whole and a part-filled step, rows
past the last tile, gpt-oss's biases and clamped SwiGLU, wide scales, foreign pairs of
weight 0); launch shapes that do not depend on the routing; and the tuner's candidate list
in experts_triton_mxfp4. bfloat16 runs on a GPU only (the interpreter truncates casts to
bfloat16: test_mxfp4_decode_experts.py)."""

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
import shoal.layers.moe.mxfp4_decode_words as words  # noqa: E402
import shoal.layers.moe.triton_experts_mxfp4 as mxfp4_moe  # noqa: E402
from shoal.layers.moe.mxfp4_decode_words import WordTiles, experts_mxfp4_words  # noqa: E402
from shoal.layers.moe.mxfp4_experts import Mxfp4Experts, Mxfp4Weights  # noqa: E402
from shoal.layers.moe.triton_experts_mxfp4 import (  # noqa: E402
    experts_mxfp4_reference,
    experts_triton_mxfp4,
)
from shoal.layers.quantization import launch_tuner  # noqa: E402
from shoal.layers.quantization.mxfp4 import E2M1_VALUES  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# H = I = 288 inputs (9 blocks, 36 words): with one warp (32 words, 256 inputs a K step) a
# whole step and a part-filled one, with two (512 inputs a step) one part-filled step
E, TOP_K, H, INTER = 4, 2, 288, 288
TILES = {  # the interpreter: few programs, and I = H = 288 outputs end in a part-filled tile
    # (rows past it read the last row, not stored); a GPU: tiles of word_tiles' sizes (these
    # spill on sm_90, and real outputs, whole blocks of 32, fill tiles of up to 32 rows)
    "one-warp": WordTiles(64, 128, num_warps=1) if INTERPRET else WordTiles(4, 2, num_warps=1),
    "two-warp": WordTiles(32, 64, num_warps=2) if INTERPRET else WordTiles(8, 4, num_warps=2),
}


# the shared cases' helpers at this file's shape
SHAPE = ExpertsShape(E, TOP_K, H, INTER, DEV)
packed_experts, routed, biases = SHAPE.packed_experts, SHAPE.routed, SHAPE.biases


@triton.jit
def _decode_words(w_ptr, out_ptr, low3_mask, half_mask, N: tl.constexpr):
    """out[n, i] = e2m1 value of code i of word n: _word_dot against one-hot inputs."""
    offs = tl.arange(0, N)
    w = tl.load(w_ptr + offs).to(tl.uint32, bitcast=True)
    one = tl.full([N], 1.0, tl.float32)
    o = tl.zeros([N], tl.float32)
    m = low3_mask
    h = half_mask
    out = out_ptr + offs * 8
    tl.store(out, words._word_dot(w, m, h, one, o, o, o, o, o, o, o) * 16384.0)
    tl.store(out + 1, words._word_dot(w, m, h, o, one, o, o, o, o, o, o) * 16384.0)
    tl.store(out + 2, words._word_dot(w, m, h, o, o, one, o, o, o, o, o) * 16384.0)
    tl.store(out + 3, words._word_dot(w, m, h, o, o, o, one, o, o, o, o) * 16384.0)
    tl.store(out + 4, words._word_dot(w, m, h, o, o, o, o, one, o, o, o) * 16384.0)
    tl.store(out + 5, words._word_dot(w, m, h, o, o, o, o, o, one, o, o) * 16384.0)
    tl.store(out + 6, words._word_dot(w, m, h, o, o, o, o, o, o, one, o) * 16384.0)
    tl.store(out + 7, words._word_dot(w, m, h, o, o, o, o, o, o, o, one) * 16384.0)


def test_every_code_in_every_position_of_a_word_decodes_exactly() -> None:
    """Code i of a word (bits 4i .. 4i + 3: input 8j + i) is the format's value exactly,
    the subnormal 0.5, the signs of codes 3 and 7 (7's is bit 31) and signed zeros
    included: the 16 words of one code in all positions, and random words (each code's
    neighbours vary)."""
    g = torch.Generator().manual_seed(0)
    uniform = torch.arange(16, dtype=torch.int64) * 0x11111111
    mixed = torch.randint(0, 1 << 32, (240,), dtype=torch.int64, generator=g)
    w64 = torch.cat([uniform, mixed])
    w = (w64 - (w64 >= 1 << 31).long() * (1 << 32)).to(torch.int32)  # the same bits, int32
    out = torch.empty(256, 8, device=DEV)
    _decode_words[(1,)](w.to(DEV), out, words.LOW3, words.HALF, N=256)
    codes = (w64[:, None] >> (4 * torch.arange(8))[None, :]) & 15
    assert torch.equal(out.cpu(), torch.tensor(E2M1_VALUES)[codes])


CASES = {  # dtype, gpt-oss's biases and clamped SwiGLU, tiles, tokens
    "fp32-gpt-oss-one-warp": (torch.float32, True, "one-warp", 3),
    "fp32-silu-two-warp": (torch.float32, False, "two-warp", 1),
    "fp16-gpt-oss-one-warp": (torch.float16, True, "one-warp", 2),
    "bf16-gpt-oss-one-warp": (torch.bfloat16, True, "one-warp", 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_word_kernels_match_the_dequantized_weights(case: str) -> None:
    """check_against_the_twin (tests/mxfp4_cases.py): float32 to 1e-5 of the largest output,
    half precision to four units in the last place in norm."""
    dtype, gpt_oss_mlp, tiles, t = CASES[case]
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the interpreter truncates casts to bfloat16 (the module docstring)")
    check_against_the_twin(functools.partial(experts_mxfp4_words, tiles=TILES[tiles]), SHAPE, dtype,
                           gpt_oss_mlp, t)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-gate): inf, as on a GPU
def test_wide_scales_and_foreign_pairs_with_weight_zero() -> None:
    """check_wide_scales_and_foreign_pairs (tests/mxfp4_cases.py): scales 2^-27 .. 2^22, and a
    pair of routing weight 0 (another expert-parallel rank's) adding nothing."""
    check_wide_scales_and_foreign_pairs(functools.partial(experts_mxfp4_words, tiles=TILES["one-warp"]), SHAPE)


def test_launch_shapes_do_not_depend_on_the_routing(monkeypatch) -> None:
    """What a CUDA graph needs: the same T and k launch the same two kernels on the same
    grids and buffer shapes whatever the routing (spread over the experts, or all on two)."""
    launches: list = []
    record_launches(monkeypatch, launches,
                    [(words, "_gate_up_words_kernel"), (words, "_down_words_kernel")])
    q = packed_experts(seed=7)
    for ids in (torch.tensor([[0, 1], [2, 3]]), torch.tensor([[3, 1]] * 2)):
        x, weights, ids = routed(2, seed=8, ids=ids)
        got = experts_mxfp4_words(x, q, weights, ids, TILES["one-warp"])
        want = experts_mxfp4_reference(x, q, weights, ids)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert [n for n, *_ in launches] == ["_gate_up_words_kernel", "_down_words_kernel"] * 2
    assert launches[:2] == launches[2:]
    tiles = TILES["one-warp"]
    assert launches[0][1] == (2 * TOP_K, triton.cdiv(INTER, tiles.block_n))
    assert launches[1][1] == (2, triton.cdiv(H, tiles.down_block_n))


def test_the_tuner_times_the_word_tiles_where_the_blocks_fit(monkeypatch) -> None:
    """experts_triton_mxfp4 lists every word tile after the first form's tiles (the grouped
    path first on a GPU: the reference the tuner checks against); path="words" runs the
    first word tile; blocks at an address the word loads cannot take (1 byte past 4-byte
    alignment) list none, and path="words" is refused."""
    asked: list = []

    def first(key, names, run, device, agree):
        assert agree == launch_tuner.EXACT_OPERANDS_AGREE
        asked.append(tuple(names))
        return run(names[0])

    monkeypatch.setattr(mxfp4_moe, "run_fastest", first)
    q = packed_experts(seed=9)
    x, weights, ids = routed(1, seed=10)
    experts_triton_mxfp4(x, q, weights, ids)
    first_form = [c.name for c in decode.decode_tiles(1, H, INTER, DEV)]
    word_names = [c.name for c in words.word_tiles(1, H, INTER, DEV)]
    assert word_names and asked == [
        ("grouped", *first_form, *word_names) if DEV.type == "cuda"
        else (*first_form, *word_names, "grouped")]
    got = experts_triton_mxfp4(x, q, weights, ids, path="words")
    want = experts_mxfp4_reference(x, q, weights, ids)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()

    def shifted(w: Mxfp4Weights) -> Mxfp4Weights:
        flat = torch.empty(w.blocks.numel() + 1, dtype=torch.uint8, device=DEV)
        blocks = flat[1:].view(w.blocks.shape)
        blocks.copy_(w.blocks)
        return Mxfp4Weights(blocks, w.scales)

    odd = Mxfp4Experts(shifted(q.w13), shifted(q.w2))
    assert not words.words_fit(odd)
    monkeypatch.setattr(mxfp4_moe, "run_fastest", lambda key, names, run, device, agree:
                        asked.append(tuple(names)) or got)
    experts_triton_mxfp4(x, odd, weights, ids)
    assert not set(asked[-1]) & set(word_names)
    with pytest.raises(ValueError, match="path 'words' needs"):
        experts_triton_mxfp4(x, odd, weights, ids, path="words")


def test_word_tiles_refuse_what_the_kernels_cannot_take() -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        WordTiles(6, 2)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        WordTiles(4, 2, num_warps=3)
