"""The gate GEMV and the softmax top-k routing in one Triton launch (layers/moe/gate_routing.py)
against the unfused pair it replaces (F.linear, then router.py's select_experts_torch /
topk_then_softmax_torch): T 1 / 3 / 8, E 8 / 64 / 256, k 2 / 8, both orders, renormalize on
and off, a bias (GPT-OSS), bf16 / fp16 / fp32; the logits the routing read (F.linear's to a
rounding), its routing of them (topk_routing.py's experts; its weights bit for bit when
interpreted), repeated calls (the last program resets the counter), the routers' choice of path, and a tiny Qwen3-MoE through the
engine (transformers' tokens). Interpreted on the CPU (TRITON_INTERPRET=1, set by this
directory's conftest.py: the interpreter runs the programs one after another, so the
last-program step's memory ordering is only exercised on a GPU), compiled on a GPU, where a
test times the fused launch against the unfused pair at Qwen3.5-35B-A3B's gate in a CUDA
graph."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from shoal.layers.moe import gate_routing, router, topk_routing  # noqa: E402
from shoal.layers.moe.gate_routing import (  # noqa: E402
    MAX_TOKENS,
    GateRoutingPlan,
    fits_fused,
    plan_gate_routing,
)
from shoal.models.gpt_oss import GptOssRouter  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VARIANTS = [("softmax_then_topk", True), ("softmax_then_topk", False),
            ("topk_then_softmax", False)]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
# weights, each position against the unfused path's (whose logits may be an ulp away)
WEIGHT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}


def few_programs(e: int) -> GateRoutingPlan | None:
    """On the CPU at most 4 programs (the interpreter's cost is per program), H in 64-wide
    chunks (several, the last one masked, for H = 200); compiled: the default plan."""
    if DEV.type == "cuda":
        return None
    return GateRoutingPlan(experts_per_program=max(1, e // 4), block_hidden=64, num_warps=1)


def inputs(t: int, e: int, h: int, dtype: torch.dtype, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    w = (torch.randn(e, h, generator=g) / h ** 0.5).to(DEV, dtype)
    b = torch.randn(e, generator=g).to(DEV, dtype) if bias else None
    return x, w, b


def torch_routing(logits: torch.Tensor, k: int, order: str,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if order == "softmax_then_topk":
        return router.select_experts_torch(logits, k, renormalize)
    return router.topk_then_softmax_torch(logits, k)


def logit_tolerance(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                    logits: torch.Tensor) -> torch.Tensor:
    """How far [T, E] logits summed in another order may lie from F.linear's: both float32
    sums within H * 2^-24 * sum |x w| (+ |b|) of the exact one, then (half dtypes) one ulp
    of the dtype where the two sums straddle a rounding boundary."""
    mag = x.float().abs() @ w.float().abs().T
    if b is not None:
        mag = mag + b.float().abs()
    tol = 2 * x.shape[1] * 2.0 ** -24 * mag
    if x.dtype != torch.float32:
        _, exp = torch.frexp(logits.float())
        tol = tol + torch.ldexp(torch.ones_like(tol), exp - 1 - MANTISSA[x.dtype])
    return tol


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int, order: str,
          renormalize: bool, plan: GateRoutingPlan | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    got_w, got_ids = gate_routing.gate_routing(x, w, k, order, renormalize, bias=b, plan=plan)
    t, e = x.shape[0], w.shape[0]
    assert got_w.shape == got_ids.shape == (t, k)
    assert got_w.dtype == x.dtype and got_ids.dtype == torch.int64
    logits = F.linear(x, w, b)
    ref = logits.float()
    tol = logit_tolerance(x, w, b, logits)
    # the logits the last program routed: F.linear's (rounded to its dtype), to a rounding
    seen = gate_routing._SCRATCH[(x.device, e)].logits[:t]
    assert bool(((seen - ref).abs() <= tol).all()), (
        f"fused logits off F.linear's by {(seen - ref).abs().max().item():.3g}")
    assert torch.equal(seen.to(x.dtype).float(), seen), "logits not rounded to x's dtype"
    # ... and its routing of them is topk_routing.py's: the same experts, and the same
    # weights bit for bit when interpreted; compiled, each kernel sums the softmax in its own
    # tile order (H200, 2026-12-06: 5 cases differed in the weights, never in the experts),
    # so there to a few float32 ulps and then one of x's dtype
    one_program = None if DEV.type == "cuda" else topk_routing.RoutingPlan(
        _pow2(t), _pow2(e), _pow2(k), 1)  # (interpreted: the cost is per program)
    kernel_w, kernel_ids = topk_routing.topk_routing(seen.to(x.dtype), k, order, renormalize,
                                                     plan=one_program)
    assert torch.equal(got_ids, kernel_ids)
    if DEV.type == "cuda":
        torch.testing.assert_close(got_w.float(), kernel_w.float(), atol=0,
                                   rtol=2 ** -20 + 2 ** -MANTISSA[x.dtype])
    else:
        assert torch.equal(got_w, kernel_w)
    # against the unfused torch path: each position's pick is the reference's, or one whose
    # logit is within rounding of it; a different set of experts only where the reference's
    # k-th and (k+1)-th logits are within rounding of each other (the margin)
    want_w, want_ids = torch_routing(logits, k, order, renormalize)
    pair_tol = tol.gather(1, got_ids) + tol.gather(1, want_ids)
    gap = (ref.gather(1, got_ids) - ref.gather(1, want_ids)).abs()
    assert bool((gap <= pair_tol).all()), (
        f"picks differ by more than rounding:\n{got_ids.tolist()}\n{want_ids.tolist()}")
    ranked, order_ids = ref.sort(dim=-1, descending=True, stable=True)
    for row in range(t):
        if set(got_ids[row].tolist()) != set(want_ids[row].tolist()):
            assert k < e
            margin = (ranked[row, k - 1] - ranked[row, k]).item()
            limit = (tol[row, order_ids[row, k - 1]] + tol[row, order_ids[row, k]]).item()
            assert margin <= limit, (
                f"row {row}: another expert set though the k-th logit leads the next by "
                f"{margin:.3g} (rounding {limit:.3g})")
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=WEIGHT_RTOL[x.dtype],
                               atol=1e-6)
    assert bool((got_w[:, 1:] <= got_w[:, :-1]).all()), "weights not largest first"
    assert gate_routing._SCRATCH[(x.device, e)].count.item() == 0, "counter not reset"
    return got_w, got_ids


# ---- against the unfused path ------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("e", [8, 64, 256])
def test_against_flinear_and_the_torch_routing(t: int, e: int) -> None:
    """Every order, k 2 and 8 and bf16 / fp32 in turn; H = 200 is no power of two (a masked
    tail; several chunks where the plan's are 64 wide). bf16 logits of 256 experts tie
    often: the margin check above says where the unfused path may pick otherwise."""
    for n, (order, renormalize) in enumerate(VARIANTS):
        dtype = (torch.bfloat16, torch.float32)[(n + t) % 2]
        k = (2, 8)[(n + e) % 2]
        x, w, _ = inputs(t, e, 200, dtype, seed=t * e + n)
        check(x, w, None, k, order, renormalize, few_programs(e))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_as_gpt_oss(dtype: torch.dtype) -> None:
    """F.linear with a bias adds it before its one rounding; GPT-OSS-20B's k = 4 of 32."""
    x, w, b = inputs(3, 32, 96, dtype, seed=4, bias=True)
    check(x, w, b, 4, "topk_then_softmax", False, few_programs(32))


def test_repeated_calls_reset_the_counter_and_repeat_bit_for_bit() -> None:
    """Calls of one E (one scratch and counter) at changing T, each the same as its first:
    the last program of every launch resets the counter the next one counts on."""
    cases = [inputs(t, 64, 128, torch.bfloat16, seed=t) for t in (1, 8, 3)]
    plan = few_programs(64)
    first = [gate_routing.gate_routing(x, w, 4, "softmax_then_topk", True, plan=plan)
             for x, w, _ in cases]
    for (x, w, _), (want_w, want_ids) in zip(cases, first):
        got_w, got_ids = check(x, w, None, 4, "softmax_then_topk", True, plan)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("t, e, k, order, renormalize", [
    (1, 256, 8, "softmax_then_topk", True), (3, 512, 10, "softmax_then_topk", True),
    (2, 32, 4, "topk_then_softmax", False), (1, 6, 3, "softmax_then_topk", False),
    (1, 8, 1, "softmax_then_topk", False)])
@pytest.mark.skipif(not gate_routing.HAVE_TOPK, reason="this Triton has no tl.topk")
def test_the_bitonic_picks_are_the_k_maxima_bit_for_bit(t: int, e: int, k: int, order: str,
                                                        renormalize: bool) -> None:
    """GateRoutingPlan.bitonic (the default where Triton has tl.topk): Triton's bitonic
    top-k of the keys instead of k maxima one after another, the same ids and weights bit
    for bit (the keys are distinct), k not a power of two (10, 3: the slots past k unused),
    k = 1 (one maximum either way) and E not a power of two (6) included."""
    x, w, _ = inputs(t, e, 200, torch.bfloat16, seed=e + k)
    base = few_programs(e) or plan_gate_routing(t, e, 200)
    want = check(x, w, None, k, order, renormalize, dataclasses.replace(base, bitonic=False))
    got = check(x, w, None, k, order, renormalize, dataclasses.replace(base, bitonic=True))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_strided_rows_and_the_default_plan() -> None:
    """x rows apart (a slice of a wider buffer): read through its row stride; the default
    plan (a program an expert, one chunk of H)."""
    x, w, _ = inputs(3, 8, 64, torch.float32, seed=9)
    wide = torch.zeros(3, 80, device=DEV)
    wide[:, 5:69] = x
    check(wide[:, 5:69], w, None, 2, "softmax_then_topk", True)


# ---- shapes and plans ---------------------------------------------------------------------


def test_what_it_takes_and_bad_arguments() -> None:
    x, w, b = inputs(2, 8, 16, torch.bfloat16, seed=1, bias=True)
    assert fits_fused(x, w, 2) and fits_fused(x, w, 8, b)
    assert not fits_fused(torch.zeros(MAX_TOKENS + 1, 16, dtype=x.dtype, device=DEV), w, 2)
    assert not fits_fused(x[:0], w, 2)
    assert not fits_fused(x.float(), w, 2)  # F.linear's dtypes differ
    assert not fits_fused(x, w, 2, b.float())
    assert not fits_fused(x, w, 9)
    big = torch.zeros(topk_routing.MAX_EXPERTS + 1, 16, dtype=x.dtype, device=DEV)
    assert not fits_fused(x, big, 2)
    with pytest.raises(ValueError, match="gate_routing takes x"):
        gate_routing.gate_routing(x, w, 0, "softmax_then_topk")
    with pytest.raises(ValueError, match="order"):
        gate_routing.gate_routing(x, w, 2, "softmax")
    with pytest.raises(ValueError, match="renormalize"):
        gate_routing.gate_routing(x, w, 2, "topk_then_softmax", renormalize=True)


def test_plans() -> None:
    """One warp (the routing's chain in shuffles) for a token of <= 256 experts, one expert
    a program up to 256 experts; 8 warps and four experts a program at the limit; bitonic
    picks where Triton has tl.topk."""
    bitonic = gate_routing.HAVE_TOPK
    assert plan_gate_routing(1, 256, 2048) == GateRoutingPlan(1, 2048, 1, bitonic)
    assert plan_gate_routing(1, 256, 2048).grid(256) == (256,)
    assert plan_gate_routing(8, 256, 2048) == GateRoutingPlan(1, 2048, 8, bitonic)
    assert plan_gate_routing(1, 512, 2048) == GateRoutingPlan(2, 2048, 2, bitonic)
    assert plan_gate_routing(1, 32, 2880) == GateRoutingPlan(1, 2048, 1, bitonic)
    assert plan_gate_routing(8, 1024, 7168) == GateRoutingPlan(4, 4096, 8, bitonic)


# ---- which path the routers take ----------------------------------------------------------


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """Counts the fused launches (T) and the unfused pair's GEMMs and routing launches; any
    tensor counts as a device tensor (on the CPU the kernels are interpreted)."""
    calls: list[str] = []
    fused, routing, linear = (gate_routing.gate_routing, topk_routing.topk_routing,
                              router.F.linear)

    def counted_fused(x, *args, **kwargs):
        calls.append(f"fused T={x.shape[0]}")
        return fused(x, *args, **kwargs)

    def counted_routing(logits, *args, **kwargs):
        calls.append("routing")
        return routing(logits, *args, **kwargs)

    def counted_linear(*args):
        calls.append("linear")
        return linear(*args)

    monkeypatch.setattr(gate_routing, "gate_routing", counted_fused)
    monkeypatch.setattr(topk_routing, "topk_routing", counted_routing)
    monkeypatch.setattr(F, "linear", counted_linear)
    monkeypatch.setattr(router, "use_triton", lambda x, enabled: enabled)
    return calls


def _routers() -> tuple[router.TopKRouter, GptOssRouter]:
    g = torch.Generator().manual_seed(5)
    qwen = router.TopKRouter(16, 8, 2, True, torch.bfloat16)
    oss = GptOssRouter(16, 8, 2, torch.bfloat16)
    for p in (qwen.weight, oss.weight, oss.bias):
        p.copy_(torch.randn(p.shape, generator=g))
    return qwen.to(DEV), oss.to(DEV)


def test_routers_take_the_fused_launch_at_decode_sizes(launches: list[str]) -> None:
    qwen, oss = _routers()
    x = torch.randn(MAX_TOKENS + 1, 16, generator=torch.Generator().manual_seed(6))
    x = x.to(DEV, torch.bfloat16)
    for r, order, renormalize, bias in ((qwen, "softmax_then_topk", True, None),
                                        (oss, "topk_then_softmax", False, oss.bias)):
        launches.clear()
        got_w, got_ids = r(x[:3])
        assert launches == ["fused T=3"]
        want = gate_routing.gate_routing(x[:3], r.weight, 2, order, renormalize, bias=bias)
        assert torch.equal(got_w, want[0]) and torch.equal(got_ids, want[1])
        launches.clear()
        r(x)  # past MAX_TOKENS: the GEMM, then the routing kernel
        assert launches == ["linear", "routing"]
        want = torch_routing(F.linear(x[:3], r.weight, bias), 2, order, renormalize)
        launches.clear()
        r.use_triton_ops = False  # the model's switch: the torch code, bit for bit
        got = r(x[:3])
        assert launches == ["linear"]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cpu_tensors_keep_the_torch_code_bit_for_bit() -> None:
    qwen, oss = _routers()
    if DEV.type == "cuda":
        qwen, oss = qwen.cpu(), oss.cpu()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = qwen(x)
    want = router.select_experts_torch(F.linear(x, qwen.weight), 2, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = oss(x)
    want = router.topk_then_softmax_torch(F.linear(x, oss.weight, oss.bias), 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- through the engine -------------------------------------------------------------------

QWEN3_MOE = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)


def test_tiny_qwen3_moe_through_the_engine_gives_transformers_tokens(monkeypatch,
                                                                     tmp_path) -> None:
    """Greedy float32 with every router on the Triton kernels (the interpreter on the CPU):
    the decode steps' one-token routing takes the fused launch, the prompt the GEMM and the
    routing kernel; the tokens and logprobs are transformers'."""
    from oracle import check_against_hf, greedy_with_logprobs, write_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from shoal import LLM

    path = write_tiny_checkpoint(tmp_path, "qwen3_moe", seed=2, **QWEN3_MOE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    monkeypatch.setattr(router, "use_triton", lambda x, enabled: enabled)
    rows: list[int] = []
    fused = gate_routing.gate_routing

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return fused(x, *args, **kwargs)

    monkeypatch.setattr(gate_routing, "gate_routing", counted)
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=32,
              max_model_len=64, enforce_eager=True)
    started = len(rows)  # (a GPU's start-up passes route too)
    prompts = [[5, 77, 300, 12, 9, 61, 4, 250, 33, 18, 7]]
    outs = greedy_with_logprobs(llm, prompts, 4)
    assert rows[started:] == [1] * 2 * 3, (
        f"fused launches of {rows[started:]} tokens: 3 decode steps x 2 MoE layers of one "
        "token expected")
    check_against_hf(outs, prompts, hf, 4)


# ---- the GPU: Qwen3.5-35B-A3B's gate ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_against_the_unfused_pair_in_a_cuda_graph() -> None:
    """E = 256, H = 2048, k = 8, bf16 (Qwen3.5-35B-A3B; 40 MoE layers a step), and E = 512,
    k = 10 at T = 1 (Qwen3-Next): F.linear + topk_routing against the fused launch (its
    default plan, the k maxima, other warps), T = 1, 2, 4, 8, replayed from a CUDA
    graph: one gate read 20 times (L2-resident) and 128 gates read once each (128 MB: from
    HBM, as in a step whose experts' reads evict the gates). Every call of a 200-call graph
    is checked (the last-program step's memory ordering, which the interpreter cannot
    exercise)."""
    from gpu_timing import graph_of_calls, time_ms

    h = 2048
    for e, k, t in [(256, 8, 1), (256, 8, 2), (256, 8, 4), (256, 8, 8), (512, 10, 1)]:
        x, w, _ = inputs(t, e, h, torch.bfloat16, seed=t)
        check(x, w, None, k, "softmax_then_topk", True)
        gates = [(torch.randn(e, h, device="cuda") / h ** 0.5).to(torch.bfloat16)
                 for _ in range(128)]
        bitonic = gate_routing.HAVE_TOPK
        plans = {"fused": None,  # (the default plan: bitonic picks where Triton has them)
                 "fused maxima": dataclasses.replace(plan_gate_routing(t, e, h), bitonic=False)}
        if (e, t) == (256, 1):
            plans["fused 4 warps"] = GateRoutingPlan(2, 2048, 4, bitonic)
        if e == 512:  # (the default: 2 warps)
            plans["fused 1 warp"] = GateRoutingPlan(2, 2048, 1, bitonic)

        def unfused(w=w, x=x, k=k):
            return topk_routing.topk_routing(F.linear(x, w), k, "softmax_then_topk", True)

        def unfused_cold(x=x, gates=gates, k=k):
            return [topk_routing.topk_routing(F.linear(x, g), k, "softmax_then_topk", True)
                    for g in gates]

        line = f"[E={e} H={h} k={k} bf16 T={t}]"
        runs = [("unfused", unfused, unfused_cold)]
        for name, plan in plans.items():
            def hot(w=w, x=x, plan=plan, k=k):
                return gate_routing.gate_routing(x, w, k, "softmax_then_topk", True, plan=plan)

            def cold(x=x, plan=plan, gates=gates, k=k):
                return [gate_routing.gate_routing(x, g, k, "softmax_then_topk", True,
                                                  plan=plan) for g in gates]
            runs.append((name, hot, cold))
        for name, hot, cold in runs:
            replay, calls = graph_of_calls(hot)
            cold_replay, _ = graph_of_calls(cold, calls=1)
            line += (f" {name}: eager {time_ms(hot) * 1e3:.1f} us, graph"
                     f" {time_ms(replay) * 1e3 / calls:.2f} us (L2), "
                     f"{time_ms(cold_replay, iters=10) * 1e3 / len(gates):.2f} us (HBM);")
        print("\n" + line, end="")

        # 200 launches in one graph, each output kept: all equal the eager call's
        want_w, want_ids = gate_routing.gate_routing(x, w, k, "softmax_then_topk", True)
        outs: list = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(200):
                outs.append(gate_routing.gate_routing(x, w, k, "softmax_then_topk", True))
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, want_w) and torch.equal(b, want_ids) for a, b in outs)
        assert gate_routing._SCRATCH[(x.device, e)].count.item() == 0
    print()
