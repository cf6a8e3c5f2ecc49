"""The decode path of bf16 / fp16 experts (shoal/layers/moe/half_decode_experts.py) on the CPU
through Triton's interpreter (conftest.py), on tiny shapes: its output against experts_torch,
a float32 reference that rounds gate / up and the activation as the kernel does, and the
grouped GEMMs (SiLU and gpt-oss's clamped SwiGLU, biases or not, k = 1..4 slots, strided x
rows); a split down projection against an unsplit one; launch shapes that do not depend on
the routing (CUDA graphs); experts_triton's choice of path; bad inputs. A GPU test checks
every launch candidate at DeepSeek-V2-Lite's, Qwen3-30B-A3B's and Mixtral's expert shapes and
prints the grouped path's and each decode tile's time.

bfloat16 in the interpreter: casts to bfloat16 truncate (round to nearest on a GPU), and its
tl.dot of bfloat16 is wrong (test_fused_moe.py), so bfloat16 is compared with the rounded
reference and experts_torch only, at a tolerance that takes a truncation a rounding."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

from launch_recorder import record_launches  # noqa: E402

import shoal.layers.moe.half_decode_experts as decode  # noqa: E402
import shoal.layers.moe.triton_experts as grouped_moe  # noqa: E402
from shoal.layers.moe.activation import SILU, ExpertActivation  # noqa: E402
from shoal.layers.moe.half_decode_experts import (  # noqa: E402
    MAX_TOKENS,
    HalfDecodeTiles,
    experts_half_decode,
)
from shoal.layers.moe.torch_experts import experts_torch  # noqa: E402
from shoal.layers.moe.triton_experts import experts_triton  # noqa: E402
from shoal.layers.ops.half_gemv import k_per_split  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# H = 80 inputs, I = 48: with the interpreter's tile (decode_tiles: 32 outputs a program,
# K steps of 32, down split in two) gate_up's K ends in a part-filled step, down's two
# splits are a whole step and a part-filled one, and both end in a part-filled tile of rows
E, H, INTER = 4, 80, 48
CLAMPED = ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.0)  # limits the data reaches
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def experts(seed: int, dtype: torch.dtype, bias: bool = True
            ) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    out = dict(w13=torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5,
               w2=torch.randn(E, H, INTER, generator=g) / INTER ** 0.5,
               w13_bias=torch.randn(E, 2 * INTER, generator=g) * 0.3 if bias else None,
               w2_bias=torch.randn(E, H, generator=g) * 0.3 if bias else None)
    return {k: None if v is None else v.to(DEV, dtype) for k, v in out.items()}


def routed(t: int, k: int, seed: int, dtype: torch.dtype, e: int = E, h: int = H,
           strided: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, h] (strided: rows 16 apart more than h), weights and ids [t, k] of k distinct
    experts a token (the routers' rule)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h + 16 * strided, generator=g)[:, :h]
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    return x.to(DEV, dtype), weights.to(DEV, dtype), ids.to(DEV)


def rounded_reference(x: torch.Tensor, w: dict, weights: torch.Tensor, ids: torch.Tensor,
                      activation: ExpertActivation) -> torch.Tensor:
    """float32 [T, H] pair by pair from x's dtype's operands, with gate / up and the
    activation rounded to x's dtype as the kernel rounds them (the output is not rounded)."""
    t, k = ids.shape
    pairs = ids.reshape(-1).long()
    tokens = torch.arange(t * k, device=x.device) // k
    gate_up = torch.bmm(w["w13"].float()[pairs], x.float()[tokens][:, :, None])[:, :, 0]
    if w["w13_bias"] is not None:
        gate_up = gate_up + w["w13_bias"].float()[pairs]
    act = activation(gate_up.to(x.dtype).float()).to(x.dtype).float()
    down = torch.bmm(w["w2"].float()[pairs], act[:, :, None])[:, :, 0]
    if w["w2_bias"] is not None:
        down = down + w["w2_bias"].float()[pairs]
    return (down * weights.float().reshape(-1, 1)).view(t, k, -1).sum(dim=1)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


CASES = {  # tokens, slots, activation, biases, dtype, x rows strided
    "fp32-t1-k1-silu": (1, 1, SILU, False, torch.float32, True),
    "fp32-t2-k3-clamped-bias": (2, 3, CLAMPED, True, torch.float32, False),
    "fp16-t3-k4-silu-bias": (3, 4, SILU, True, torch.float16, True),
    "fp16-t2-k2-clamped": (2, 2, CLAMPED, False, torch.float16, False),
    "bf16-t3-k2-clamped-bias": (3, 2, CLAMPED, True, torch.bfloat16, False),
    "bf16-t1-k4-silu": (1, 4, SILU, False, torch.bfloat16, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_path_matches_torch_and_the_grouped_path(case: str) -> None:
    """float32: experts_torch and the grouped GEMMs to 1e-5 of the largest output (only the
    summation order differs). Half precision, in relative norm: the rounded reference to 4
    units in the last place (the kernel rounds the output once more; a gate or up value
    near a tie may round the other way with another summation order, a unit in one of
    many values), the grouped path (fp16: it rounds each pair's down row too) to 6 and
    experts_torch (which rounds after every op) to 16."""
    t, k, act, bias, dtype, strided = CASES[case]
    w = experts(seed=len(case), dtype=dtype, bias=bias)
    x, weights, ids = routed(t, k, seed=t * 10 + k, dtype=dtype, strided=strided)
    got = experts_triton(x, w["w13"], w["w2"], weights, ids, w["w13_bias"], w["w2_bias"],
                         activation=act, path="decode")
    assert got.dtype == dtype and got.shape == (t, H)
    torch_out = experts_torch(x, w["w13"], w["w2"], weights, ids, w["w13_bias"],
                              w["w2_bias"], activation=act)
    grouped = None if dtype == torch.bfloat16 and INTERPRET else experts_triton(
        x, w["w13"], w["w2"], weights, ids, w["w13_bias"], w["w2_bias"], activation=act,
        path="grouped")
    if dtype == torch.float32:
        for want in (torch_out, grouped):
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), err
        return
    ulp = ULP[dtype] * (2 if INTERPRET and dtype == torch.bfloat16 else 1)  # (truncation)
    assert rel(got, rounded_reference(x, w, weights, ids, act)) < 4 * ulp
    assert rel(got, torch_out) < 16 * ulp
    if grouped is not None:
        assert rel(got, grouped) < 6 * ulp


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_routers_dtypes_int32_ids_and_float32_weights(dtype: torch.dtype) -> None:
    """What the routers hand over: int32 ids and float32 routing weights beside a half x (the
    cases above use int64 ids and weights in x's dtype)."""
    w = experts(seed=7, dtype=dtype, bias=True)
    x, weights, ids = routed(2, 3, seed=23, dtype=dtype)
    weights32, ids32 = weights.float() * 1.001, ids.to(torch.int32)
    got = experts_triton(x, w["w13"], w["w2"], weights32, ids32, w["w13_bias"], w["w2_bias"],
                         path="decode")
    want = experts_triton(x, w["w13"], w["w2"], weights32, ids32.long(), w["w13_bias"],
                          w["w2_bias"], path="decode")
    assert torch.equal(got, want)  # (the ids' width changes nothing)
    ulp = ULP[dtype] * (2 if INTERPRET and dtype == torch.bfloat16 else 1)
    torch_out = experts_torch(x.float(), w["w13"].float(), w["w2"].float(), weights32,
                              ids32.long(), w["w13_bias"].float(), w["w2_bias"].float())
    assert rel(got, torch_out) < 16 * ulp


def test_split_down_matches_unsplit_and_other_tiles() -> None:
    """The same experts through a split down projection (float32 partials, summed in split
    order), an unsplit one, and narrower tiles and K steps: float32 sums in other orders."""
    w = experts(seed=3, dtype=torch.float32)
    x, weights, ids = routed(2, 3, seed=4, dtype=torch.float32)
    args = (x, w["w13"], w["w2"], weights, ids)
    bias = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], activation=CLAMPED)
    outs = [experts_half_decode(*args, tiles, **bias) for tiles in (
        HalfDecodeTiles(32, 32, 32, 2, num_warps=1), HalfDecodeTiles(32, 32, 32, 1, num_warps=1),
        HalfDecodeTiles(16, 64, 16, 3, num_warps=1))]
    for other in outs[1:]:
        assert rel(other, outs[0]) < 1e-6
    want = experts_torch(*args, **bias)
    assert rel(outs[0], want) < 1e-6


def _recording(monkeypatch, launches: list) -> None:
    """Every launch of the decode kernels and of the grouped GEMM appended as (kernel, grid,
    argument shapes)."""
    record_launches(monkeypatch, launches, [
        (decode, "_gate_up_kernel"), (decode, "_down_kernel"), (decode, "sum_splits_kernel"),
        (grouped_moe, "_grouped_gemm_kernel")])


def test_launch_shapes_do_not_depend_on_the_routing(monkeypatch) -> None:
    """What a CUDA graph needs: the same T and k launch the same three kernels on the same
    grids and buffer shapes whatever the routing (spread over the experts, or all on two)."""
    launches: list = []
    _recording(monkeypatch, launches)
    w = experts(seed=5, dtype=torch.float32, bias=False)
    tiles = HalfDecodeTiles(32, 32, 32, 2, num_warps=1)
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        x, weights, _ = routed(3, 2, seed=6, dtype=torch.float32)
        ids = ids.to(DEV)
        got = experts_half_decode(x, w["w13"], w["w2"], weights, ids, tiles)
        want = experts_torch(x, w["w13"], w["w2"], weights, ids)
        assert rel(got, want) < 1e-6
    assert [n for n, *_ in launches] == ["_gate_up_kernel", "_down_kernel", "sum_splits_kernel"] * 2
    assert launches[:3] == launches[3:]
    assert launches[0][1] == (3 * 2, 2) and launches[1][1] == (3, 3, 2)


def test_experts_triton_picks_the_decode_path_for_a_few_half_tokens(monkeypatch) -> None:
    """Untimed on the CPU: fp16 / bf16 up to MAX_TOKENS rows take the decode path; float32
    (unless asked), more rows, a LoRA hook or path="grouped" take the grouped GEMMs; an
    unknown path or a decode path of too many rows is refused."""
    launches: list = []
    _recording(monkeypatch, launches)
    monkeypatch.setattr(grouped_moe, "MAX_TOKENS", 2)  # fewer rows to run above it
    w = experts(seed=7, dtype=torch.float16, bias=False)
    x, weights, ids = routed(2, 2, seed=8, dtype=torch.float16)
    args = (w["w13"], w["w2"], weights, ids)

    def kernels() -> list[str]:
        names = [n for n, *_ in launches]
        launches.clear()
        return names

    first = decode.decode_tiles(2, 2, H, INTER, DEV)[0]  # the tiles path="decode" runs
    splits = k_per_split(INTER, first.block_k, first.split)[1]
    decode_kernels = ["_gate_up_kernel", "_down_kernel"] + ["sum_splits_kernel"] * (splits > 1)
    if DEV.type != "cuda":  # (on a GPU the choice is the tuner's: launch_tuner.py)
        assert splits == 2  # the interpreter runs both down paths (decode_tiles)
        experts_triton(x, *args)
        assert kernels() == decode_kernels
    experts_triton(x, *args, path="decode")
    assert kernels() == decode_kernels
    experts_triton(x, *args, path="grouped")
    assert kernels() == ["_grouped_gemm_kernel"] * 2

    class NoDelta:  # a LoRA hook whose adapters add nothing
        def add(self, *args) -> None:
            pass

    experts_triton(x, *args, lora=NoDelta(), path="decode")
    assert kernels() == ["_grouped_gemm_kernel"] * 2
    x32 = x.float()
    experts_triton(x32, w["w13"].float(), w["w2"].float(), weights, ids)
    assert kernels() == ["_grouped_gemm_kernel"] * 2
    x3, weights3, ids3 = routed(3, 2, seed=9, dtype=torch.float16)
    experts_triton(x3, w["w13"], w["w2"], weights3, ids3)
    assert kernels() == ["_grouped_gemm_kernel"] * 2
    with pytest.raises(ValueError, match="path must be None or one of"):
        experts_triton(x, *args, path="gemv")
    with pytest.raises(ValueError, match="takes 1..2 tokens"):
        experts_triton(x3, w["w13"], w["w2"], weights3, ids3, path="decode")


def test_bad_inputs_raise_naming_the_field() -> None:
    w = experts(seed=10, dtype=torch.float16)
    x, weights, ids = routed(2, 2, seed=11, dtype=torch.float16)
    tiles = decode.decode_tiles(2, 2, H, INTER, DEV)[0]
    with pytest.raises(ValueError, match="do not fit"):
        experts_half_decode(x, w["w13"], w["w2"][:, :, :8], weights, ids, tiles)
    with pytest.raises(ValueError, match="w2_bias"):
        experts_half_decode(x, w["w13"], w["w2"], weights, ids, tiles,
                            w2_bias=w["w2_bias"][:, :8])
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        experts_half_decode(x, w["w13"].float(), w["w2"], weights, ids, tiles)
    with pytest.raises(ValueError, match=r"must both be \[2, k\]"):
        experts_half_decode(x, w["w13"], w["w2"], weights[:1], ids[:1], tiles)
    many = x.new_zeros(MAX_TOKENS + 1, H)
    with pytest.raises(ValueError, match=f"takes 1..{MAX_TOKENS}"):
        experts_half_decode(many, w["w13"], w["w2"], weights.new_ones(MAX_TOKENS + 1, 2),
                            ids.new_zeros(MAX_TOKENS + 1, 2), tiles)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        HalfDecodeTiles(48, 32, 32, 1)
    with pytest.raises(ValueError, match="block_k must be >= 8"):
        HalfDecodeTiles(32, 32, 4, 1)
    with pytest.raises(ValueError, match=r"split must be in \[1, 64\]"):
        HalfDecodeTiles(32, 32, 32, 0)


# ---- the GPU: each candidate at real shapes, and its time ------------------------------------

GPU_SHAPES = {  # name: (E, H, I, k)
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_candidates_agree_and_their_times(shape: str) -> None:
    """bf16 at T = 1 and 4: every decode tile against experts_torch and the grouped path
    (relative norm); the time of the grouped path and each tile (launch_tuner.gpu_time_us:
    ten calls in one CUDA graph), printed (run with -s), every one finite (launched); the
    tuner's pick agreeing with the grouped path; and experts_triton captured in a CUDA graph
    replayed with another routing, and its time."""
    from shoal.layers.quantization import launch_tuner

    e, h, inter, k = GPU_SHAPES[shape]
    dtype = torch.bfloat16
    g = torch.Generator(DEV).manual_seed(12)  # (on the GPU: Mixtral's are 2.8 GB)
    w13 = torch.randn(e, 2 * inter, h, generator=g, device=DEV, dtype=dtype) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g, device=DEV, dtype=dtype) / inter ** 0.5
    ulp = ULP[dtype]
    for t in (1, 4):
        x, weights, ids = routed(t, k, seed=13 + t, dtype=dtype, e=e, h=h)
        want = experts_torch(x, w13, w2, weights, ids)
        grouped = experts_triton(x, w13, w2, weights, ids, path="grouped")
        assert rel(grouped, want) < 8 * ulp
        times = {"grouped": launch_tuner.gpu_time_us(
            lambda x=x, weights=weights, ids=ids: experts_triton(x, w13, w2, weights, ids,
                                                                 path="grouped"))}
        for tiles in decode.decode_tiles(t, k, h, inter, DEV):
            got = experts_half_decode(x, w13, w2, weights, ids, tiles)
            assert rel(got, want) < 8 * ulp, tiles.name
            assert rel(got, grouped) < 4 * ulp, tiles.name
            times[tiles.name] = launch_tuner.gpu_time_us(
                lambda x=x, weights=weights, ids=ids, tiles=tiles: experts_half_decode(
                    x, w13, w2, weights, ids, tiles))
        moved = t * k * 3 * h * inter * 2  # bytes of the routed experts (distinct ids a token)
        print(f"\n{shape} T={t} bf16 ({moved / 1e6:.1f} MB of experts, at most):")
        for name, us in times.items():
            print(f"  {name:40s} {us:8.1f} us  {moved / us / 1e3:7.0f} GB/s")
        assert all(us < float("inf") for us in times.values()), times
        tuned = experts_triton(x, w13, w2, weights, ids)  # the tuner's pick, timed once
        assert rel(tuned, grouped) < 4 * ulp
        # a CUDA graph of the default path, replayed with another routing
        static_w, static_ids = weights.clone(), ids.clone()
        experts_triton(x, w13, w2, static_w, static_ids)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts_triton(x, w13, w2, static_w, static_ids)
        _, weights2, ids2 = routed(t, k, seed=99 + t, dtype=dtype, e=e, h=h)
        static_w.copy_(weights2)
        static_ids.copy_(ids2)
        graph.replay()
        assert rel(out, experts_torch(x, w13, w2, weights2, ids2)) < 8 * ulp
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        prefix = ("half experts", e, 2 * inter, h, k, t, dtype, False, False, "silu")
        pick = next((v.choice for key, v in launch_tuner.TUNED.items()
                     if key[:len(prefix)] == prefix), "untimed: grouped")
        print(f"  tuner's pick ({pick}), a graph of one call replayed: "
              f"{start.elapsed_time(end) * 1e3 / 20:.1f} us")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_expert_offsets_past_two_to_the_31() -> None:
    """70 experts of 4096 x 8192 bf16 (w13 2.35G elements, 9.4 GB with w2): the last
    experts start past element 2^31, so an offset computed in int32 would read the wrong
    rows. Tokens routed to experts 69 and 68 against torch on those experts alone."""
    e, inter, h = 70, 2048, 8192
    g = torch.Generator(device="cuda").manual_seed(3)
    w13 = torch.empty(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(e, h, inter, device="cuda", dtype=torch.bfloat16)
    for w, fan_in in ((w13, h), (w2, inter)):  # (expert by expert: no 9 GB float32 temp)
        for i in range(e):
            w[i].normal_(0, fan_in ** -0.5, generator=g)
    x = torch.randn(2, h, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.tensor([[69, 68], [68, 69]], device="cuda", dtype=torch.int32)
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]], device="cuda")
    got = experts_triton(x, w13, w2, weights, ids, path="decode")
    local = torch.tensor([[1, 0], [0, 1]], device="cuda")  # (68 -> 0, 69 -> 1)
    want = experts_torch(x.float(), w13[68:].float(), w2[68:].float(), weights, local)
    assert rel(got, want) < 16 * ULP[torch.bfloat16]
