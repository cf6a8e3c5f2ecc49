"""The DeepSeek routing kernel (shoal/layers/moe/deepseek_routing_kernel.py) against the torch
code it replaces (deepseek_router.py: route_v2, route_v3): V2 greedy and group-limited greedy,
V3 noaux_tc with and without renormalizing, the released configs' shapes (V2-Lite 64 / 6,
V2 160 / 6 in 8 groups keeping 3, V3 256 / 8 in 8 groups keeping 4, Kimi-K2 384 / 8 in one
group) and small ones, T 0 / 1 / 7 / 64, packed and strided rows, ties (lower expert and
lower group first), -inf and very negative logits; and which path DeepseekRouter takes.
Interpreted on the CPU (TRITON_INTERPRET=1, set by this directory's conftest.py), compiled
where there is a GPU. The GPU test prints torch's chain against the kernel's one launch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from shoal.layers.moe import deepseek_routing_kernel, router  # noqa: E402
from shoal.layers.moe.deepseek_router import DeepseekRouter, route_v2, route_v3  # noqa: E402
from shoal.layers.moe.topk_routing import RoutingPlan  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel's float32 weights against torch's for the same experts. On the GPU: the same
# expf and divisions, sums in another order. Interpreted: numpy's exp against torch's CPU exp
# and sigmoid: at most 6 measured.
ULPS = 4 if DEV == "cuda" else 8


@dataclass(frozen=True)
class Config:
    name: str
    experts: int
    top_k: int
    method: str
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    scale: float = 1.0

    @property
    def v3(self) -> bool:
        return self.method == "noaux_tc"

    @property
    def grouped(self) -> bool:
        return self.method != "greedy" and self.topk_group < self.n_group


REAL = [Config("v2-lite", 64, 6, "greedy"),
        Config("v2", 160, 6, "group_limited_greedy", 8, 3, scale=16.0),
        Config("v3", 256, 8, "noaux_tc", 8, 4, True, 2.5),
        Config("v3-no-renorm", 256, 8, "noaux_tc", 8, 4, False, 2.5),
        Config("kimi-k2", 384, 8, "noaux_tc", 1, 1, True, 2.827)]
SMALL = [Config("greedy-k1", 8, 1, "greedy"),
         Config("v2-groups-of-3", 12, 3, "group_limited_greedy", 4, 1, scale=0.5),
         Config("v2-all-groups-kept", 16, 4, "group_limited_greedy", 4, 4),
         Config("v3-three-groups", 12, 4, "noaux_tc", 3, 2, True, 1.5),
         Config("v3-groups-of-2", 16, 2, "noaux_tc", 8, 1, False),
         Config("v3-all-groups-kept", 32, 6, "noaux_tc", 4, 4, True)]


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def one_program(t: int, k: int) -> RoutingPlan | None:
    """On the CPU every row in one program (the interpreter's cost is per program); compiled,
    the default plan. (block_experts is unused: the tile follows the config's groups.)"""
    return None if DEV == "cuda" else RoutingPlan(pow2(max(t, 1)), 0, pow2(k), 1)


def run_kernel(logits: torch.Tensor, c: Config, bias: torch.Tensor | None,
               out_dtype: torch.dtype = torch.float32,
               plan: RoutingPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return deepseek_routing_kernel.deepseek_routing(
        logits, c.top_k, c.method, c.n_group, c.topk_group, c.renormalize, c.scale,
        bias if c.v3 else None, out_dtype=out_dtype, plan=plan)


def run_torch(logits: torch.Tensor, c: Config,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if c.v3:
        return route_v3(logits, bias, c.top_k, c.n_group, c.topk_group, c.renormalize,
                        c.scale)
    return route_v2(logits, c.top_k, c.method, c.n_group, c.topk_group, c.scale)


def ranked(logits: torch.Tensor, c: Config, bias: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's steps with ties broken as the kernel breaks them (the lower index first):
    (scores, the masked values the experts are picked among, the ids in the kernel's order,
    the rows where the last group kept ties the next: torch may keep either)."""
    if c.v3:
        scores = logits.sigmoid()
        choice = scores + bias
    else:
        scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
    t, e = choice.shape
    group_tie = torch.zeros(t, dtype=torch.bool, device=logits.device)
    if c.grouped:
        per_group = choice.view(t, c.n_group, e // c.n_group)
        group_scores = (per_group.topk(2, dim=-1)[0].sum(-1) if c.v3
                        else per_group.max(dim=-1).values)
        ordered, best = torch.sort(group_scores, dim=-1, descending=True, stable=True)
        group_tie = ordered[:, c.topk_group - 1] == ordered[:, c.topk_group]
        keep = torch.zeros(t, c.n_group, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, best[:, :c.topk_group], True)
        keep = keep.repeat_interleave(e // c.n_group, dim=1)
        choice = choice.masked_fill(~keep, float("-inf") if c.v3 else 0.0)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :c.top_k]
    return scores, choice, ids, group_tie


def ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def check(logits: torch.Tensor, c: Config, bias: torch.Tensor | None,
          out_dtype: torch.dtype = torch.float32,
          plan: RoutingPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = run_kernel(logits, c, bias, out_dtype, plan)
    t = logits.shape[0]
    assert w.shape == ids.shape == (t, c.top_k)
    assert w.dtype == out_dtype and ids.dtype == torch.int64
    want_w, want_ids = run_torch(logits, c, bias)
    scores, choice, order_ids, group_tie = ranked(logits, c, bias)
    # ids: largest first, equal values (groups, experts) by lower index
    assert torch.equal(ids, order_ids)
    picked = choice.gather(1, ids)
    assert bool((picked[:, :-1] >= picked[:, 1:]).all())
    # where torch's kept groups are certain: the values picked are torch's, and every expert
    # torch picks whose value is the row's only one, the kernel picks too
    sure = ~group_tie
    torch_picked = choice.gather(1, want_ids)
    assert torch.equal(picked.sort(dim=-1).values[sure],
                       torch_picked.sort(dim=-1).values[sure])
    unique = ((choice[:, None, :] == torch_picked[:, :, None]).sum(-1) == 1) & sure[:, None]
    found = (want_ids[:, :, None] == ids[:, None, :]).any(-1)
    assert bool(found[unique].all())
    # weights: torch's float32 ones for the kernel's ids, within ULPS ulps, then rounded
    if c.v3:
        ref = scores.gather(1, ids)
        if c.renormalize:
            ref = ref / (ref.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        ref = picked
    ref = ref * c.scale
    tol = ULPS * ulp(ref)
    lo, hi = (ref - tol).to(out_dtype), (ref + tol).to(out_dtype)
    assert bool(((lo <= w) & (w <= hi)).all()), (w.float() - ref).abs().max()
    # and torch's own weights, expert by expert, where it picked the same experts
    same = (ids.sort(-1).values == want_ids.sort(-1).values).all(-1)
    got_by_id = w.gather(1, ids.argsort(-1))[same].float()
    want_by_id = want_w.gather(1, want_ids.argsort(-1))[same].to(out_dtype).float()
    rel = {torch.float32: ULPS * 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
    torch.testing.assert_close(got_by_id, want_by_id, rtol=rel[out_dtype], atol=1e-30)
    return w, ids


def make(c: Config, t: int, seed: int, spread: float = 2.0
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, c.experts, generator=g) * spread
    bias = torch.randn(c.experts, generator=g) * 0.05 if c.v3 else None
    return logits.to(DEV), None if bias is None else bias.to(DEV)


# ---- against torch ------------------------------------------------------------------------


@pytest.mark.parametrize("c", REAL + SMALL, ids=lambda c: c.name)
def test_random_logits_64_rows(c: Config) -> None:
    logits, bias = make(c, 64, seed=c.experts + c.top_k)
    check(logits, c, bias, plan=one_program(64, c.top_k))


@pytest.mark.parametrize("t", [0, 1, 7])
@pytest.mark.parametrize("c", REAL, ids=lambda c: c.name)
def test_token_counts_with_the_default_plan(c: Config, t: int) -> None:
    logits, bias = make(c, t, seed=t)
    check(logits, c, bias)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_weights_rounded_once_to_the_activation_dtype(out_dtype: torch.dtype) -> None:
    for c in (REAL[1], REAL[2]):
        logits, bias = make(c, 16, seed=11)
        check(logits, c, bias, out_dtype, one_program(16, c.top_k))


def test_packed_rows_with_a_partial_last_program_and_strided_rows() -> None:
    c = Config("v3-small", 32, 4, "noaux_tc", 4, 2, True, 2.0)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 40, generator=g).to(DEV)
    logits = wide[:, 5:37]
    assert logits.stride() == (40, 1)
    bias = (torch.randn(32, generator=g) * 0.1).to(DEV)
    plan = RoutingPlan(4, 0, 4, 1)  # 2 programs, the second with 3 rows
    check(logits, c, bias, plan=plan)
    check(logits, Config("v2-small", 32, 4, "group_limited_greedy", 4, 2), None, plan=plan)
    check(wide.t().contiguous().t()[:, :32], c, bias)  # columns strided: copied


def test_ties_pick_the_lower_expert_and_the_lower_group_first() -> None:
    """Equal logits, groups whose best (V2) or two best (V3) tie: the lower group is kept and
    the lower expert picked first, as a stable descending sort orders them."""
    v2 = Config("v2", 8, 3, "group_limited_greedy", 4, 2)
    rows = [[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, -1.0],
            [0.5] * 8,
            [0.0, 2.0, 1.0, 1.0, 2.0, 0.0, 1.0, 2.0],
            [1.0, 3.0, 3.0, 1.0, 3.0, 1.0, 1.0, 3.0]]
    logits = torch.tensor(rows, device=DEV)
    # groups of 2, 2 kept. V2 (best of a group): row 0's four groups tie, row 2's groups 0,
    # 2 and 3 tie (0 and 2 kept), row 3's four tie
    v2 = Config("v2", 8, 3, "group_limited_greedy", 4, 2)
    _, ids = check(logits, v2, None, plan=one_program(4, 3))
    assert ids.tolist() == [[1, 2, 0], [0, 1, 2], [1, 4, 0], [1, 2, 0]]
    greedy = Config("greedy", 8, 5, "greedy")
    _, ids = check(logits, greedy, None, plan=one_program(4, 5))
    assert ids.tolist() == [[1, 2, 4, 6, 5], [0, 1, 2, 3, 4], [1, 4, 7, 2, 3],
                            [1, 2, 4, 7, 0]]
    # V3 (sum of a group's two best): rows 1 and 3 tie in all four groups (a sum of the same
    # two floats either way round); row 0 keeps groups 2 and 0, row 2 groups 3 and 1
    v3 = Config("v3", 8, 3, "noaux_tc", 4, 2, True, 2.5)
    zero = torch.zeros(8, device=DEV)
    _, ids = check(logits, v3, zero, plan=one_program(4, 3))
    assert ids.tolist() == [[1, 4, 5], [0, 1, 2], [7, 2, 3], [1, 2, 0]]


def test_minus_infinity_and_very_negative_logits() -> None:
    """-inf logits; probabilities that underflow to 0 (greedy: picked with weight 0, lowest
    index first; group-limited: kept experts and masked ones tie at 0, lowest index first);
    V3: sigmoid 0 (the choice is the bias alone), with and without renormalizing."""
    inf = float("inf")
    rows = [[-inf, 1.0, -inf, 0.5, -inf, -inf, 2.0, -inf],
            [-inf, -inf, 0.0, -inf, -inf, -inf, -inf, -inf],
            [-1e30, 1.0, -1e30, 0.5, -1e30, -1e30, 2.0, 1.5],
            [-200.0, -200.0, -200.0, -200.0, -200.0, 3.0, -200.0, -200.0],
            [-1e30] * 8]
    logits = torch.tensor(rows, device=DEV)
    w, ids = check(logits, Config("greedy", 8, 4, "greedy", scale=3.0), None,
                   plan=one_program(5, 4))
    assert ids[:2].tolist() == [[6, 1, 3, 0], [2, 0, 1, 3]]
    assert ids[3].tolist() == [5, 0, 1, 2]
    assert w[1, 0] == 3 and not w[1, 1:].any() and not w[3, 1:].any()
    v2 = Config("v2", 8, 4, "group_limited_greedy", 4, 2, scale=2.0)
    w, ids = check(logits, v2, None, plan=one_program(5, 4))
    # groups 2 (experts 4, 5) and 0 kept; masked expert 2 ties the kept zeros, as torch's
    # masked_fill(0.0) makes it
    assert ids[3].tolist() == [5, 0, 1, 2]
    bias = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.05, 0.0, -0.1, 0.15], device=DEV)
    for renormalize in (True, False):
        c = Config("v3", 8, 3, "noaux_tc", 4, 2, renormalize, 2.5)
        w, ids = check(logits, c, bias, plan=one_program(5, 3))
        assert ids[1].tolist() == [2, 3, 1]  # sigmoid 1/2 + 0.2, then the biases of group 1, 0
        assert not w[1, 1:].any()
        assert ids[4].tolist() == [3, 2, 1] and not w[4].any()  # all scores 0: no 0 / 0


def test_bad_arguments_raise() -> None:
    x = torch.zeros(2, 16, device=DEV)
    bias = torch.zeros(16, device=DEV)
    route = deepseek_routing_kernel.deepseek_routing
    with pytest.raises(ValueError, match="method"):
        route(x, 2, "softmax")
    with pytest.raises(ValueError, match="top_k 17"):
        route(x, 17, "greedy")
    with pytest.raises(ValueError, match="logits must be float32"):
        route(x.bfloat16(), 2, "greedy")
    with pytest.raises(ValueError, match="renormalize"):
        route(x, 2, "greedy", renormalize=True)
    with pytest.raises(ValueError, match="float32 bias"):
        route(x, 2, "noaux_tc", 4, 2)
    with pytest.raises(ValueError, match="n_group 3 must divide"):
        route(x, 2, "noaux_tc", 3, 2, bias=bias)
    with pytest.raises(ValueError, match="exceeds"):
        route(x, 5, "group_limited_greedy", 4, 1)
    with pytest.raises(ValueError, match="two best"):
        route(x, 2, "noaux_tc", 16, 2, bias=bias)
    with pytest.raises(ValueError, match="out_dtype"):
        route(x, 2, "greedy", out_dtype=torch.float64)
    with pytest.raises(ValueError, match="num_experts 1025"):
        route(torch.zeros(2, 1025, device=DEV), 2, "greedy")


# ---- which path DeepseekRouter takes ----------------------------------------------------------


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """Counts the kernel's launches (each method's name)."""
    calls: list[str] = []
    real = deepseek_routing_kernel.deepseek_routing

    def counted(logits, top_k, method, *args, **kwargs):
        calls.append(method)
        return real(logits, top_k, method, *args, **kwargs)
    monkeypatch.setattr(deepseek_routing_kernel, "deepseek_routing", counted)
    return calls


def _router(c: Config, device: str, use_triton_ops: bool = True) -> DeepseekRouter:
    cfg = SimpleNamespace(hidden_size=16, n_routed_experts=c.experts,
                          num_experts_per_tok=c.top_k, n_group=c.n_group,
                          topk_group=c.topk_group, routed_scaling_factor=c.scale,
                          norm_topk_prob=c.renormalize, topk_method=c.method,
                          scoring_func="sigmoid" if c.v3 else "softmax")
    r = DeepseekRouter(cfg, use_triton_ops=use_triton_ops)
    g = torch.Generator().manual_seed(c.experts)
    r.weight.copy_(torch.randn(c.experts, 16, generator=g) / 4)
    if c.v3:
        r.e_score_correction_bias.copy_(torch.randn(c.experts, generator=g) * 0.05)
    return r.to(device)


def _torch_forward(r: DeepseekRouter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekRouter.forward's torch code."""
    logits = torch.nn.functional.linear(x.float(), r.weight.float())
    if r.version == 2:
        w, ids = route_v2(logits, r.top_k, r.topk_method, r.n_group, r.topk_group,
                          r.routed_scaling_factor)
    else:
        w, ids = route_v3(logits, r.e_score_correction_bias, r.top_k, r.n_group,
                          r.topk_group, r.renormalize, r.routed_scaling_factor)
    return w.to(x.dtype), ids


CONFIGS = [Config("v2-lite", 16, 3, "greedy"),
           Config("v2", 16, 3, "group_limited_greedy", 4, 2, scale=16.0),
           Config("v3", 16, 3, "noaux_tc", 4, 2, True, 2.5)]


def test_cpu_tensors_keep_the_torch_code(launches: list[str]) -> None:
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for c in CONFIGS:
        r = _router(c, "cpu")
        got, want = r(x), _torch_forward(r, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert launches == []


def test_device_tensors_take_the_kernel(monkeypatch, launches: list[str]) -> None:
    """A CUDA tensor (on the CPU: any tensor, with the device test patched, the kernel
    interpreted) routes through the kernel, one launch, weights in x's dtype;
    use_triton_ops=False keeps the torch code bit for bit."""
    if DEV == "cpu":
        monkeypatch.setattr(router, "use_triton", lambda x, enabled: enabled)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7)).to(DEV)
    for dtype in (torch.bfloat16, torch.float32):
        for c in CONFIGS:
            r = _router(c, DEV)
            w, ids = r(x.to(dtype))
            want_w, want_ids = _torch_forward(r, x.to(dtype))
            assert w.dtype == dtype and ids.dtype == torch.int64
            assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
            torch.testing.assert_close(w.gather(1, ids.argsort(-1)),
                                       want_w.gather(1, want_ids.argsort(-1)),
                                       rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -20,
                                       atol=0)
    assert launches == ["greedy", "group_limited_greedy", "noaux_tc"] * 2
    for c in CONFIGS:  # the model's switch off: the torch code
        r = _router(c, DEV, use_triton_ops=False)
        got, want = r(x), _torch_forward(r, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(launches) == 6


def test_models_pass_their_switch() -> None:
    from shoal.models.deepseek_v2 import DeepseekMoE
    from shoal.models.glm4_moe import Glm4MoeSparseBlock

    cfg = SimpleNamespace(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=8, n_shared_experts=0, n_group=1,
                          topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
                          norm_topk_prob=True, routed_scaling_factor=1.0)
    for ops in (True, False):
        assert DeepseekMoE(cfg, torch.float32, ops).gate.use_triton_ops is ops
        assert Glm4MoeSparseBlock(cfg, torch.float32, ops).gate.use_triton_ops is ops


# ---- GPU timing -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_times_torch_chain_against_kernel() -> None:
    """The released configs' routing of float32 logits to bf16 weights (DeepseekRouter's
    forward after its projection): torch's chain (route_v2 / route_v3, then the cast) against
    the one launch, eagerly (launch-bound) and replayed from a CUDA graph of 20 calls (device
    time, as in a decode step)."""
    from gpu_timing import graph_of_calls, time_ms

    for c in REAL:
        for t in (1, 64):
            logits, bias = make(c, t, seed=t)
            check(logits, c, bias, torch.bfloat16)
            check(logits, c, bias)

            def chain(x=logits, c=c, b=bias):
                w, ids = run_torch(x, c, b)
                return w.to(torch.bfloat16), ids

            def kernel(x=logits, c=c, b=bias):
                return run_kernel(x, c, b, torch.bfloat16)
            line = f"[{c.name} E={c.experts} k={c.top_k} {c.method} T={t}]"
            for name, fn in (("torch", chain), ("kernel", kernel)):
                replay, calls = graph_of_calls(fn)
                line += (f" {name} eager {time_ms(fn) * 1e3:.1f} us,"
                         f" graph {time_ms(replay) * 1e3 / calls:.2f} us;")
            print("\n" + line, end="")
    print()
