"""The softmax top-k routing kernel (shoal/layers/moe/topk_routing.py) against the torch code it
replaces (router.py: select_experts_torch, topk_then_softmax_torch): both orders, float32 /
bf16 / fp16 logits, renormalize on and off, 8 to 512 experts, k 1 to 10, T 0 / 1 / 7 / 64,
rows packed several a program, strided rows, ties (lower expert index first), -inf and very
negative logits; and which path select_experts and GptOssRouter take. Interpreted on the CPU
(TRITON_INTERPRET=1, set by this directory's conftest.py), compiled where there is a GPU. The
GPU test prints torch's chain against the kernel's one launch."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from shoal.layers.moe import gate_routing, router, topk_routing  # noqa: E402
from shoal.layers.moe.topk_routing import RoutingPlan, plan_routing  # noqa: E402
from shoal.models.gpt_oss import GptOssRouter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernel's float32 weights before the final rounding against torch's. On the GPU: the
# same expf, sums in another order. Interpreted: numpy's exp against torch's CPU exp (up to 2
# ulps apart) and torch's CPU softmax multiplying by 1 / sum: at most 6 measured.
ULPS = 4 if DEV == "cuda" else 8
VARIANTS = [("softmax_then_topk", True), ("softmax_then_topk", False),
            ("topk_then_softmax", False)]


def one_program(t: int, e: int, k: int) -> RoutingPlan | None:
    """On the CPU every row in one program: the kernel code of plan_routing's packed rows, and
    the interpreter's cost is per program (its numpy ops), not per row. Compiled: the default
    plan (a block of 64 x 512 keys would only spill)."""
    if DEV == "cuda":
        return None
    return RoutingPlan(triton_pow2(t), triton_pow2(e), triton_pow2(k), 1)


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def torch_routing(logits: torch.Tensor, k: int, order: str,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if order == "softmax_then_topk":
        return router.select_experts_torch(logits, k, renormalize)
    return router.topk_then_softmax_torch(logits, k)


def float32_weights(logits: torch.Tensor, k: int, order: str,
                    renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's weights before their final rounding (float32), and the probabilities or
    logits the picks are made among."""
    if order == "softmax_then_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w = probs.topk(k, dim=-1).values
        return (w / w.sum(-1, keepdim=True) if renormalize else w), probs
    top = logits.topk(k, dim=-1).values
    return torch.softmax(top.float(), dim=-1), logits.float()


def ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def check(logits: torch.Tensor, k: int, order: str, renormalize: bool,
          plan: RoutingPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = topk_routing.topk_routing(logits, k, order, renormalize, plan=plan)
    t = logits.shape[0]
    assert w.shape == ids.shape == (t, k)
    assert w.dtype == logits.dtype and ids.dtype == torch.int64
    want_w, want_ids = torch_routing(logits, k, order, renormalize)
    ref32, ranked = float32_weights(logits, k, order, renormalize)
    # ids: the values picked are torch's, in its order; equal values by lower expert index
    # (a stable descending sort), so ids equal torch's wherever the value is the row's only
    # one (torch.topk leaves the order of ties unspecified)
    order_ids = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, order_ids)
    assert torch.equal(ranked.gather(1, ids), ranked.gather(1, want_ids))
    picked = ranked.gather(1, want_ids)
    unique = (ranked[:, None, :] == picked[:, :, None]).sum(-1) == 1
    assert torch.equal(ids[unique], want_ids[unique])
    # weights: within ULPS float32 ulps of torch's before rounding, then rounded
    tol = ULPS * ulp(ref32)
    lo, hi = (ref32 - tol).to(logits.dtype), (ref32 + tol).to(logits.dtype)
    finite = ref32.isfinite()
    assert bool(((lo <= w) & (w <= hi))[finite].all()), (w - ref32).abs().max()
    rel = {torch.float32: ULPS * 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
    torch.testing.assert_close(w, want_w, rtol=rel[logits.dtype], atol=0)
    return w, ids


# ---- against torch ------------------------------------------------------------------------


@pytest.mark.parametrize("order,renormalize", VARIANTS)
def test_random_logits_every_expert_count_and_k(order: str, renormalize: bool) -> None:
    """E in {8, 32, 128, 512} x k in {1, 2, 4, 8}, the dtypes in turn; Qwen3-Next's 512 / 10
    and a count that is no power of two, near the kernel's limit. bf16 logits tie often."""
    g = torch.Generator().manual_seed(1)
    shapes = [(e, k) for e in (8, 32, 128, 512) for k in (1, 2, 4, 8)] + [(512, 10), (1000, 3)]
    for n, (e, k) in enumerate(shapes):
        dtype = DTYPES[n % 3]
        logits = (torch.randn(64, e, generator=g) * 3).to(dtype).to(DEV)
        check(logits, k, order, renormalize, one_program(64, e, k))


@pytest.mark.parametrize("t", [0, 1, 7, 64])
def test_token_counts_with_the_default_plan(t: int) -> None:
    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, 32, generator=g).to(torch.bfloat16).to(DEV)
    # (64 programs interpreted take a while: one order there, the others packed above)
    for order, renormalize in VARIANTS if t < 64 else VARIANTS[2:]:
        check(logits, 4, order, renormalize)


def test_plans() -> None:
    assert plan_routing(1, 32, 4) == RoutingPlan(1, 32, 4, 1)
    assert plan_routing(64, 512, 10) == RoutingPlan(1, 512, 16, 2)
    assert plan_routing(4096, 32, 4) == RoutingPlan(8, 32, 4, 1)
    assert plan_routing(4096, 128, 8) == RoutingPlan(2, 128, 8, 1)
    assert plan_routing(4096, 1000, 8) == RoutingPlan(1, 1024, 8, 4)
    assert plan_routing(4096, 32, 4).grid(4097) == (513,)


def test_packed_rows_with_a_partial_last_program_and_strided_rows() -> None:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 40, generator=g).to(DEV)
    logits = wide[:, 3:35]  # 32 experts, rows 40 apart
    assert logits.stride() == (40, 1)
    plan = RoutingPlan(4, 32, 4, 1)  # 2 programs, the second with 3 rows
    for order, renormalize in VARIANTS:
        check(logits, 4, order, renormalize, plan)
    check(wide.t().contiguous().t()[:, :32], 2, "topk_then_softmax", False)  # columns strided


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_pick_the_lower_expert_first(dtype: torch.dtype) -> None:
    rows = [[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, -1.0],
            [0.5] * 8,
            [-0.0, 0.0, -1.0, 0.0, -0.0, -2.0, -3.0, -4.0]]  # -0.0 ties +0.0
    logits = torch.tensor(rows, dtype=dtype, device=DEV)
    want = {3: [[1, 2, 4], [0, 1, 2], [0, 1, 3]],
            5: [[1, 2, 4, 6, 5], [0, 1, 2, 3, 4], [0, 1, 3, 4, 2]]}
    for k, ids_want in want.items():
        for order, renormalize in VARIANTS:
            _, ids = check(logits, k, order, renormalize, one_program(3, 8, k))
            assert ids.tolist() == ids_want


@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_infinity_and_very_negative_logits(dtype: torch.dtype) -> None:
    """-inf logits (some rows with fewer finite logits than k: the rest are picked with
    weight 0, lowest index first) and logits so negative their probability is 0."""
    inf = float("inf")
    low = -6e4 if dtype == torch.float16 else -1e30
    rows = [[-inf, 1.0, -inf, 0.5, -inf, -inf, 2.0, -inf],
            [-inf, -inf, 0.0, -inf, -inf, -inf, -inf, -inf],
            [low, 1.0, low, 0.5, low, low, 2.0, 1.5],
            [low, low, low, low, low, 3.0, low, low]]
    logits = torch.tensor(rows, dtype=dtype, device=DEV)
    for order, renormalize in VARIANTS:
        w, ids = check(logits, 4, order, renormalize, one_program(4, 8, 4))
        assert ids[:2].tolist() == [[6, 1, 3, 0], [2, 0, 1, 3]]
        assert ids[3].tolist() == [5, 0, 1, 2]
        assert w[1, 0] == 1 and not w[1, 1:].any() and not w[3, 1:].any()


def test_bad_arguments_raise() -> None:
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="top_k 9"):
        topk_routing.topk_routing(x, 9, "topk_then_softmax")
    with pytest.raises(ValueError, match="top_k 0"):
        topk_routing.topk_routing(x, 0, "softmax_then_topk")
    with pytest.raises(ValueError, match="num_experts 1025"):
        topk_routing.topk_routing(torch.zeros(2, 1025, device=DEV), 2, "softmax_then_topk")
    with pytest.raises(ValueError, match="order"):
        topk_routing.topk_routing(x, 2, "softmax")
    with pytest.raises(ValueError, match="renormalize"):
        topk_routing.topk_routing(x, 2, "topk_then_softmax", renormalize=True)
    with pytest.raises(ValueError, match="logits must be"):
        topk_routing.topk_routing(x.double(), 2, "softmax_then_topk")


# ---- which path the routers take ------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """Counts the kernel's launches (each order's name)."""
    calls: list[str] = []
    real = topk_routing.topk_routing

    def counted(logits, top_k, order, renormalize=False, plan=None):
        calls.append(order)
        return real(logits, top_k, order, renormalize, plan)
    monkeypatch.setattr(topk_routing, "topk_routing", counted)
    return calls


def _gpt_oss_router(dtype: torch.dtype, device: str) -> GptOssRouter:
    g = torch.Generator().manual_seed(5)
    r = GptOssRouter(16, 8, 2, dtype)
    r.weight.copy_(torch.randn(8, 16, generator=g))
    r.bias.copy_(torch.randn(8, generator=g))
    return r.to(device)


def test_cpu_tensors_keep_the_torch_code(launches: list[str]) -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for renormalize in (True, False):
        got = router.select_experts(logits, 3, renormalize)
        want = router.select_experts_torch(logits, 3, renormalize)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    r = _gpt_oss_router(torch.bfloat16, "cpu")
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    logits = torch.nn.functional.linear(x, r.weight, r.bias)
    top, ids = torch.topk(logits, 2, dim=-1)  # GptOssRouter's code before the kernel
    w = torch.softmax(top, dim=-1, dtype=top.dtype)
    got_w, got_ids = r(x)
    assert torch.equal(got_w, w) and torch.equal(got_ids, ids)
    assert launches == []


def test_device_tensors_take_the_kernel(monkeypatch, launches: list[str]) -> None:
    """A CUDA tensor (on the CPU: any tensor, with the device test patched, the kernel
    interpreted) routes through the kernel; shapes it does not take fall back to torch."""
    if DEV == "cpu":
        monkeypatch.setattr(router, "use_triton", lambda x, enabled: enabled)
    # the routers' decode-sized gate + routing launch (test_gate_routing.py) off: F.linear here
    monkeypatch.setattr(gate_routing, "fits_fused", lambda *args: False)
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 8, generator=g).to(torch.bfloat16).to(DEV)
    w, ids = router.select_experts(logits, 2, True)
    want_w, want_ids = router.select_experts_torch(logits, 2, True)
    assert launches == ["softmax_then_topk"]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=2 ** -7, atol=0)

    r = _gpt_oss_router(torch.bfloat16, DEV)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16).to(DEV)
    w, ids = r(x)
    want_w, want_ids = router.topk_then_softmax_torch(
        torch.nn.functional.linear(x, r.weight, r.bias), 2)
    assert launches == ["softmax_then_topk", "topk_then_softmax"]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=2 ** -7, atol=0)

    # past the kernel's limit, float64, [B, T, E]: the torch code, as before
    big = torch.randn(2, 1100, generator=g).to(DEV)
    assert all(torch.equal(a, b) for a, b in zip(router.select_experts(big, 4, True),
                                                  router.select_experts_torch(big, 4, True)))
    router.topk_then_softmax(logits.double(), 2)
    router.select_experts(logits[None], 2, False)
    assert len(launches) == 2

    # use_triton_ops=False (the model's switch): the torch code, bit for bit
    off = router.TopKRouter(16, 8, 2, True, torch.bfloat16, use_triton_ops=False).to(DEV)
    off.weight.copy_(torch.randn(8, 16, generator=g).to(DEV))
    got = off(x)
    want = router.select_experts_torch(torch.nn.functional.linear(x, off.weight), 2, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    r.use_triton_ops = False
    got = r(x)
    want = router.topk_then_softmax_torch(torch.nn.functional.linear(x, r.weight, r.bias), 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(launches) == 2


# ---- GPU timing -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_times_torch_chain_against_kernel() -> None:
    """bf16 logits as GPT-OSS-20B (32 experts, top 4) and Qwen3-30B-A3B (128, top 8) route
    them, plus Qwen3-Next (512, top 10): both paths eagerly (launch-bound: Python and the
    launches) and replayed from a CUDA graph of 20 calls (device time, as in a decode step)."""
    from gpu_timing import graph_of_calls, time_ms

    cases = [(32, 4, "topk_then_softmax", False), (128, 8, "softmax_then_topk", True),
             (512, 10, "softmax_then_topk", True)]
    for e, k, order, renormalize in cases:
        for t in (1, 64, 4096):
            g = torch.Generator(device="cuda").manual_seed(t)
            logits = (torch.randn(t, e, generator=g, device="cuda") * 2).to(torch.bfloat16)
            check(logits, k, order, renormalize)

            def run_torch(x=logits, k=k, o=order, r=renormalize):
                return torch_routing(x, k, o, r)

            def run_kernel(x=logits, k=k, o=order, r=renormalize):
                return topk_routing.topk_routing(x, k, o, r)
            line = f"[{order} E={e} k={k} T={t} bf16]"
            for name, fn in (("torch", run_torch), ("kernel", run_kernel)):
                replay, calls = graph_of_calls(fn)
                line += (f" {name} eager {time_ms(fn) * 1e3:.1f} us,"
                         f" graph {time_ms(replay) * 1e3 / calls:.2f} us;")
            if t == 4096:  # the packed-rows plan against a row a program
                single = plan_routing(1, e, k)

                def run_single(x=logits, k=k, o=order, r=renormalize, p=single):
                    return topk_routing.topk_routing(x, k, o, r, plan=p)
                replay, calls = graph_of_calls(run_single)
                line += f" a row a program: graph {time_ms(replay) * 1e3 / calls:.2f} us"
            print("\n" + line, end="")
    print()
