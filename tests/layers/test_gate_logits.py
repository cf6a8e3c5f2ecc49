"""The router's logits in one Triton launch (layers/moe/gate_logits.py) against the float32
GEMM (interpreter on the CPU, compiled on a GPU), and DeepseekRouter taking it at decode sizes
on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shoal.layers.moe import deepseek_router
from shoal.layers.moe.deepseek_router import DeepseekRouter
from shoal.layers.moe.gate_logits import MAX_TOKENS, fits_gate_kernel, gate_logits

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float32),
                                             (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("tokens,experts,hidden", [(1, 64, 2048), (3, 7, 1100), (8, 16, 64)])
def test_the_kernel_gives_the_float32_gemm(x_dtype, w_dtype, tokens, experts, hidden) -> None:
    """7 experts and hidden 1100 exercise the masked expert and hidden lanes."""
    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=g).to(x_dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(w_dtype)
    got = gate_logits(x.to(DEV), w.to(DEV)).cpu()
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)


def test_shapes_it_does_not_take_are_refused() -> None:
    w = torch.zeros(4, 16)
    assert not fits_gate_kernel(torch.zeros(MAX_TOKENS + 1, 16), w)
    assert not fits_gate_kernel(torch.zeros(0, 16), w)
    assert not fits_gate_kernel(torch.zeros(2, 16, dtype=torch.int8), w)
    assert not fits_gate_kernel(torch.zeros(2, 32)[:, ::2], w)
    with pytest.raises(ValueError, match="gate_logits takes x"):
        gate_logits(torch.zeros(2, 8), w)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's k (weight, id) pairs in id order: top-k with sorted=False may order the same
    choice differently on another device."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def test_the_router_takes_it_at_decode_sizes(monkeypatch) -> None:
    """Forced on for the router's tensors (on the CPU the kernel then runs in the
    interpreter): at most MAX_TOKENS tokens go through the kernel, more through the GEMM; the
    routing is the same either way. The tensors live on DEV: a GPU host runs no interpreter,
    and compiled Triton cannot read CPU tensors."""
    cfg = SimpleNamespace(n_routed_experts=16, num_experts_per_tok=4, hidden_size=64,
                          topk_method="group_limited_greedy", n_group=4, topk_group=2,
                          routed_scaling_factor=1.5, model_type="deepseek_v2")
    with torch.device(DEV):
        router = DeepseekRouter(cfg, use_triton_ops=False)
    torch.manual_seed(0)
    router.weight.data.copy_(torch.randn(router.weight.shape) * 0.3)
    x = torch.randn(MAX_TOKENS + 1, 64).to(DEV)
    want = [_by_expert(*router(x[:n])) for n in (1, MAX_TOKENS)]
    calls = []
    real = deepseek_router.F.linear

    def counted_linear(*args):
        calls.append("gemm")
        return real(*args)

    monkeypatch.setattr(deepseek_router, "use_triton", lambda t, enabled: True)
    monkeypatch.setattr(deepseek_router.F, "linear", counted_linear)
    monkeypatch.setattr(deepseek_router, "routes_on_kernel", lambda *a: False)
    for n, (w, ids) in zip((1, MAX_TOKENS), want):
        got_w, got_ids = _by_expert(*router(x[:n]))
        assert torch.equal(got_ids, ids), (
            f"{n} tokens on {DEV}: the kernel's logits chose other experts than the GEMM's:\n"
            f"{got_ids.tolist()}\n{ids.tolist()}")
        torch.testing.assert_close(got_w, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: (
            f"{n} tokens on {DEV}: routing weights from the kernel's logits differ: {m}"))
    assert calls == [], f"at <= {MAX_TOKENS} tokens the router ran the GEMM {len(calls)} times"
    router(x)
    assert calls == ["gemm"], (f"at {MAX_TOKENS + 1} tokens the router should run the GEMM "
                               f"once, ran it {len(calls)} times")
