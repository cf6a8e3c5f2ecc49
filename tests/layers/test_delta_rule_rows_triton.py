"""The fused rows kernel of the gated delta rule (shoal/layers/ops/delta_rule_rows_triton.py)
under TRITON_INTERPRET=1 against the torch rows (gated_delta_rule_rows_torch): per-head
(Gated DeltaNet) and per-key-channel (KDA) decay, rows with 0, 1, some and all T tokens
real, padding that holds NaN, head sizes that are not powers of two or span several Dv
blocks, strided inputs. The GPU test checks Qwen3.5-like shapes, a CUDA-graph replay with
new counts, and prints the times of both paths."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from gpu_timing import time_ms  # noqa: E402

from shoal.layers.ops import delta_rule_rows_triton as rows_triton  # noqa: E402
from shoal.layers.ops.delta_rule_rows import gated_delta_rule_rows_torch  # noqa: E402

TOL = {"atol": 2e-5, "rtol": 2e-5}
# The small cases run interpreted on the CPU, compiled where there is a GPU.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(R: int, T: int, H: int, Dk: int, Dv: int, per_channel: bool, device: str = DEV,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)
    q, k = rand(R, T, H, Dk), rand(R, T, H, Dk)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    v = rand(R, T, H, Dv)
    g = -rand(R, T, H, *([Dk] if per_channel else [])).abs() * 0.5
    beta = rand(R, T, H).sigmoid()
    state = rand(R, H, Dk, Dv) * 0.3
    return q, k, v, g, beta, state


def _nan_padding(counts: torch.Tensor, *tensors: torch.Tensor) -> None:
    for t in tensors:
        for r, n in enumerate(counts.tolist()):
            t[r, n:] = float("nan")


def _check_real(o: torch.Tensor, end: torch.Tensor, o_ref: torch.Tensor, end_ref: torch.Tensor,
                counts: torch.Tensor) -> None:
    for r, n in enumerate(counts.tolist()):
        torch.testing.assert_close(o[r, :n], o_ref[r, :n], **TOL)
    torch.testing.assert_close(end, end_ref, **TOL)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("Dk, Dv", [(8, 16), (6, 40)], ids=["pow2", "odd-two-blocks"])
def test_rows_match_torch_with_padding(per_channel: bool, Dk: int, Dv: int):
    R, T, H = 4, 3, 2
    q, k, v, g, beta, state = _inputs(R, T, H, Dk, Dv, per_channel)
    counts = torch.tensor([T, 1, 0, 2], dtype=torch.int32, device=DEV)  # all, one, none, some real
    _nan_padding(counts, k, v, g, beta)  # (q too would only spoil padding outputs)
    o, end = rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state, counts,
                                                      scale=0.4)
    o_ref, end_ref = gated_delta_rule_rows_torch(q, k, v, g, beta, state, counts, scale=0.4)
    assert o.shape == (R, T, H, Dv) and o.dtype == torch.float32
    assert end.shape == (R, H, Dk, Dv) and end.dtype == torch.float32
    _check_real(o, end, o_ref, end_ref, counts)
    assert torch.equal(end[2], state[2])  # a row of padding only: its state exactly as read
    assert not torch.equal(end[1], state[1])  # (one real token moves it)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_all_tokens_real_without_counts(per_channel: bool):
    q, k, v, g, beta, state = _inputs(2, 4, 3, 5, 7, per_channel, seed=1)
    o, end = rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state, None, scale=0.7)
    o_ref, end_ref = gated_delta_rule_rows_torch(q, k, v, g, beta, state, None, scale=0.7)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(end, end_ref, **TOL)


def test_strided_inputs_and_int64_counts():
    """Views as a layer passes them (v and g split off wider projections, a transposed
    state) read through their strides."""
    R, T, H, Dk, Dv = 2, 3, 2, 8, 8
    q, k, v, g, beta, state = _inputs(R, T, H, Dk, Dv, True, seed=2)
    wide = torch.randn(R, T, H, Dv + 3, device=DEV)
    wide[..., 3:] = v
    v = wide[..., 3:]
    gb = torch.randn(R, T, H, Dk + 1, device=DEV)
    gb[..., :Dk] = g
    gb[..., Dk] = beta
    g, beta = gb[..., :Dk], gb[..., Dk]
    state = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    counts = torch.tensor([2, 3], device=DEV)
    o, end = rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state, counts, scale=0.5)
    o_ref, end_ref = gated_delta_rule_rows_torch(q, k, v, g, beta, state, counts, scale=0.5)
    _check_real(o, end, o_ref, end_ref, counts)


def test_bad_shapes_are_refused():
    q, k, v, g, beta, state = _inputs(2, 2, 2, 4, 4, False)
    with pytest.raises(ValueError, match="g has shape"):
        rows_triton.gated_delta_rule_rows_triton(q, k, v, g[..., None], beta, state, None,
                                                 scale=1.0)
    with pytest.raises(ValueError, match="state has shape"):
        rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state[:1], None, scale=1.0)
    with pytest.raises(ValueError, match="counts has shape"):
        rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state,
                                                 torch.tensor([1, 2, 2], device=DEV), scale=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_qwen3_5_shapes_on_gpu_and_in_a_cuda_graph(per_channel: bool):
    """R=32 rows of T=4, 32 heads of 128 x 128: matches torch, replays in a CUDA graph with
    counts changed in place, and prints both paths' times (and other tile widths)."""
    from shoal.layers.ops.delta_rule_rows import gated_delta_rule_rows

    R, T, H, D = 32, 4, 32, 128
    q, k, v, g, beta, state = _inputs(R, T, H, D, D, per_channel, device="cuda")
    counts = torch.randint(1, T + 1, (R,), device="cuda", dtype=torch.int32)
    counts[0], counts[1] = 1, T
    o, end = gated_delta_rule_rows(q, k, v, g, beta, state, counts, scale=D ** -0.5)
    o_ref, end_ref = gated_delta_rule_rows_torch(q, k, v, g, beta, state, counts,
                                                 scale=D ** -0.5)
    tol = {"atol": 1e-4, "rtol": 1e-4}
    for r, n in enumerate(counts.tolist()):
        torch.testing.assert_close(o[r, :n], o_ref[r, :n], **tol)
    torch.testing.assert_close(end, end_ref, **tol)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, end_g = rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state, counts,
                                                              scale=D ** -0.5)
    counts.copy_(torch.arange(R, device="cuda", dtype=torch.int32) % (T + 1))
    graph.replay()
    o_ref, end_ref = gated_delta_rule_rows_torch(q, k, v, g, beta, state, counts,
                                                 scale=D ** -0.5)
    for r, n in enumerate(counts.tolist()):
        torch.testing.assert_close(o_g[r, :n], o_ref[r, :n], **tol)
    torch.testing.assert_close(end_g, end_ref, **tol)

    def run_torch() -> None:
        gated_delta_rule_rows_torch(q, k, v, g, beta, state, counts, scale=D ** -0.5)

    def run_triton() -> None:
        rows_triton.gated_delta_rule_rows_triton(q, k, v, g, beta, state, counts,
                                                 scale=D ** -0.5)
    name = "kda" if per_channel else "gdn"
    print(f"\n[{name} R={R} T={T} H={H} D={D}] torch {time_ms(run_torch) * 1e3:.1f} us, "
          f"triton {time_ms(run_triton) * 1e3:.1f} us, "
          f"triton graph replay {time_ms(graph.replay) * 1e3:.1f} us")
    for block_v in (16, 32, 64):
        for warps in (2, 4, 8):
            def run(bv: int = block_v, nw: int = warps) -> None:
                rows_triton.launch_rows(q, k, v, g, beta, state, counts, scale=D ** -0.5,
                                        block_v=bv, num_warps=nw)
            print(f"  block_v={block_v} num_warps={warps}: {time_ms(run) * 1e3:.1f} us")
