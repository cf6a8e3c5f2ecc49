"""Two projections of one input as one GEMM (layers/shared_input_linear.py): the same outputs
as the layers apart, weights written in place reach the joined matrix, sleep and wake keep it,
and anything that replaces or transforms a weight runs the layers apart again."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from shoal.layers.linear import ColumnParallelLinear, ReplicatedLinear
from shoal.layers.shared_input_linear import SharedInputLinear, settle_all
from shoal.worker.sleep_mode import put_to_sleep, wake


def _pair(seed: int = 0) -> tuple[torch.nn.Module, SharedInputLinear]:
    torch.manual_seed(seed)
    holder = torch.nn.Module()
    holder.q_proj = ColumnParallelLinear(16, 12)
    holder.kv_a = ReplicatedLinear(16, 5)
    for p in holder.parameters():
        p.data.normal_()
    holder.input_proj = SharedInputLinear(holder.q_proj, holder.kv_a)  # (as DeepseekMLA)
    return holder, holder.input_proj


def _apart(holder: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w1, w2 = holder.q_proj.weight, holder.kv_a.weight
    return x @ w1.t(), x @ w2.t()


def test_one_gemm_gives_each_layers_output_and_keeps_the_weights() -> None:
    holder, shared = _pair()
    before = {n: p.clone() for n, p in holder.named_parameters()}
    assert shared.joined_weight() is not None
    x = torch.randn(3, 16)
    for got, want in zip(shared(x), _apart(holder, x)):
        torch.testing.assert_close(got, want)
    # the names and values of the parameters are those of the layers apart
    assert sorted(before) == ["kv_a.weight", "q_proj.weight"]
    for n, p in holder.named_parameters():
        assert torch.equal(p, before[n])


def test_weights_written_in_place_reach_the_joined_matrix() -> None:
    """The loaders' copy_ (checkpoints, dummy weights, weight updates)."""
    holder, shared = _pair()
    new = torch.randn(5, 16)
    holder.kv_a.weight.weight_loader(holder.kv_a.weight, new)
    x = torch.randn(2, 16)
    _, kv = shared(x)
    torch.testing.assert_close(kv, x @ new.t())
    assert shared.joined_weight() is not None


def test_sleep_and_wake_keep_the_joined_matrix() -> None:
    holder, shared = _pair()
    x = torch.randn(2, 16)
    want = _apart(holder, x)
    asleep = put_to_sleep([holder], level=1)
    wake(asleep)
    assert shared.joined_weight() is not None
    for got, w in zip(shared(x), want):
        torch.testing.assert_close(got, w)


@pytest.mark.parametrize("change", ["replaced", "lora", "bias", "quant"])
def test_a_weight_replaced_or_transformed_runs_the_layers_apart(change) -> None:
    holder, shared = _pair()
    x = torch.randn(2, 16)
    calls = []
    if change == "replaced":  # weight offloading's p.data = a host view
        old = weakref.ref(holder.q_proj.weight.untyped_storage())
        shared.joined_weight()  # (a cached view must not keep the old storage alive)
        holder.q_proj.weight.data = holder.q_proj.weight.data.clone()
        assert shared.joined_weight() is None
        holder.kv_a.weight.data = holder.kv_a.weight.data.clone()
        gc.collect()
        assert old() is None, "the joined storage outlived both weights"
    elif change == "lora":
        class Delta:
            def apply(self, x, y):
                calls.append(1)
                y.add_(1.0)
        holder.q_proj.lora = Delta()
    elif change == "bias":
        holder.kv_a.bias = torch.nn.Parameter(torch.ones(5), requires_grad=False)
    else:
        holder.q_proj.quant = lambda t: t @ holder.q_proj.weight.t() * 2
    assert shared.joined_weight() is None
    q, kv = shared(x)
    torch.testing.assert_close(q, holder.q_proj(x))
    torch.testing.assert_close(kv, holder.kv_a(x))
    if change == "lora":
        assert calls  # the delta was applied, by the layer's own forward


def test_mismatched_projections_are_refused() -> None:
    with pytest.raises(ValueError, match="share their input size"):
        SharedInputLinear(ReplicatedLinear(16, 4), ReplicatedLinear(8, 4))
    with pytest.raises(ValueError, match="dtype and device"):
        SharedInputLinear(ReplicatedLinear(16, 4),
                          ReplicatedLinear(16, 4, params_dtype=torch.float64))


@pytest.mark.parametrize("packed", ["first", "second"])
def test_one_weight_packed_settles_into_two_storages(packed) -> None:
    """The FP8/INT4 fast path or CPU int4 replaces one layer's weight only: after load,
    settle gives the other half its own copy, so the joined matrix is freed."""
    holder, shared = _pair()
    x = torch.randn(2, 16)
    want = _apart(holder, x)
    layer = holder.q_proj if packed == "first" else holder.kv_a
    other = holder.kv_a if packed == "first" else holder.q_proj
    joined = weakref.ref(other.weight.untyped_storage())
    layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)
    assert shared.joined_weight() is None
    assert joined() is not None  # the other half still holds the whole joined storage
    assert settle_all(holder) == 1
    gc.collect()
    assert joined() is None, "the joined storage outlived settle"
    assert other.weight.untyped_storage().nbytes() == other.weight.numel() * 4
    for got, w in zip(shared(x), want):
        torch.testing.assert_close(got, w)


def test_settle_leaves_joined_and_moved_weights_alone() -> None:
    holder, shared = _pair()
    assert settle_all(holder) == 0 and shared.joined_weight() is not None
    # weights moved into a larger buffer of their own (weight offloading's host buffer)
    buffer = torch.empty(1000)
    for i, layer in enumerate((holder.q_proj, holder.kv_a)):
        w = layer.weight
        view = buffer[i * 500:i * 500 + w.numel()].view_as(w)
        view.copy_(w)
        layer.weight.data = view
    assert settle_all(holder) == 1
    for layer in (holder.q_proj, holder.kv_a):
        assert layer.weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_a_replicated_layer_over_several_ranks_keeps_the_joined_gemm_off_the_gemvs(
        monkeypatch) -> None:
    """The joined GEMM takes a Triton GEMV only where both layers may: a replicated layer over
    two tensor-parallel ranks may not (layers/linear.py), so the pair keeps F.linear."""
    from shoal.layers import linear as linear_mod
    from shoal.layers import shared_input_linear as sil

    seen = []
    real = sil.dense_linear.linear

    def spy(x, w, b=None, use_triton_ops=True):
        seen.append(use_triton_ops)
        return real(x, w, b, use_triton_ops)
    monkeypatch.setattr(sil.dense_linear, "linear", spy)
    _, one_rank = _pair()
    one_rank(torch.randn(2, 16))
    monkeypatch.setattr(linear_mod, "get_tp_world_size", lambda: 2)
    _, two_ranks = _pair()
    two_ranks(torch.randn(2, 16))
    assert seen == [True, False]
