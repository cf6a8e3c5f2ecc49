"""Weight offloading's pieces without an engine (shoal/loader/weight_offload.py,
shoal/engine/offload_args.py): the budget takes whole layers from the first and never more
than its bytes; a toy stack whose first layers live apart and are copied into one staging
buffer per layer computes what the plain stack does, takes in-place updates through its
host copies only, and refuses a parameter shared outside its layer; the engine argument's
values, its no-op on a CPU engine and its command-line flag."""

from __future__ import annotations

import argparse
import logging
import math

import pytest
import torch
from torch import nn

from shoal.engine.engine_args import EngineArgs
from shoal.engine.offload_args import WeightOffloadArgs
from shoal.entrypoints.cli_args import add_engine_flags, engine_args_from
from shoal.layers.attention import Attention
from shoal.loader.weight_offload import (
    ALIGN,
    OffloadBudget,
    WeightOffloader,
    host_weights,
    layer_layout,
)


def test_budget_takes_whole_layers_from_the_first() -> None:
    budget = OffloadBudget(100)
    assert budget.take(40) and budget.take(50)
    assert not budget.take(20)  # 110 > 100: offloading ends here ...
    assert not budget.take(5)  # ... even for a layer that would still fit
    assert budget.used == 90
    exact = OffloadBudget(96)
    assert exact.take(48) and exact.take(48) and not exact.take(1)
    assert not OffloadBudget(0).take(0) and OffloadBudget(0).closed
    with pytest.raises(ValueError, match=">= 0"):
        OffloadBudget(-1)


def test_layer_layout_aligns_every_parameter() -> None:
    params = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(75)),
              nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))]
    offsets, total = layer_layout(params)
    assert offsets == [0, ALIGN, 3 * ALIGN] and total == 4 * ALIGN


class ToyLayer(nn.Module):
    """A decoder layer to the offloader: it holds a paged Attention (unused here)."""

    def __init__(self, width: int, extra: int):
        super().__init__()
        self.attn = Attention(2, 2, 4)
        self.proj = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.extra = nn.Parameter(torch.randn(extra))  # makes the layers' sizes differ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * self.scale + self.extra.mean()


class Toy(nn.Module):
    def __init__(self, extras: tuple[int, ...] = (40, 400, 40, 40), width: int = 8):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(ToyLayer(width, e) for e in extras)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def toy(offloader: WeightOffloader | None = None) -> Toy:
    torch.manual_seed(0)
    if offloader is None:
        return Toy()
    with offloader.building():
        return Toy()


def layer_bytes(model: Toy, i: int) -> int:
    return layer_layout(list(model.layers[i].parameters()))[1]


def test_offloaded_toy_computes_the_plain_one() -> None:
    ref = toy()
    sizes = [layer_bytes(ref, i) for i in range(4)]
    budget = sizes[0] + sizes[1] + sizes[2] - 1  # two layers fit, the third does not
    off = WeightOffloader(budget, torch.device("cpu"))
    model = toy(off)
    stats = off.activate(model)
    assert stats.layers == ("layers.0", "layers.1")
    assert stats.offloaded_bytes == sizes[0] + sizes[1] <= budget
    assert stats.staging_bytes == max(sizes[0], sizes[1])
    # the offloaded layers' parameters all live in the one staging buffer; the rest not
    assert off.staging is not None
    lo = off.staging.data_ptr()
    hi = lo + off.staging.numel()

    def staged(p: torch.Tensor) -> bool:
        return lo <= p.data_ptr() < hi
    assert all(staged(p) for i in (0, 1) for p in model.layers[i].parameters())
    assert not any(staged(p) for i in (2, 3) for p in model.layers[i].parameters())
    x = torch.randn(5, 8)
    with torch.inference_mode():
        want = ref(x)
        assert torch.equal(model(x), want)
        assert torch.equal(model(x), want)  # (every pass copies its layers in again)
        # a write into the staging buffer is not the weights: the next pass copies over it
        model.layers[0].proj.weight.add_(1.0)
        assert torch.equal(model(x), want)
        # a write through the host copies is: an update of both models agrees again
        with host_weights(model):
            model.layers[0].proj.weight.mul_(2.0)
            model.layers[1].extra.add_(0.5)
        ref.layers[0].proj.weight.mul_(2.0)
        ref.layers[1].extra.add_(0.5)
        assert not torch.equal(ref(x), want)
        assert torch.equal(model(x), ref(x))
        with host_weights(model):  # and reads through them see the weights themselves
            for i in (0, 1):
                assert all(torch.equal(a, b) for a, b in zip(model.layers[i].parameters(),
                                                              ref.layers[i].parameters()))


def test_budget_below_the_first_layer_offloads_nothing(caplog) -> None:
    ref = toy()
    off = WeightOffloader(layer_bytes(ref, 0) - 1, torch.device("cpu"))
    model = toy(off)
    with caplog.at_level(logging.WARNING):
        stats = off.activate(model)
    assert stats.layers == () and stats.offloaded_bytes == 0 and off.staging is None
    assert "nothing offloaded" in caplog.text
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


def test_a_parameter_shared_outside_its_layer_is_refused() -> None:
    off = WeightOffloader(1 << 20, torch.device("cpu"))
    model = toy(off)
    model.head.weight = model.layers[0].proj.weight  # tied to a module that is not offloaded
    with pytest.raises(ValueError, match="shared"):
        off.activate(model)


def test_a_parameter_replaced_after_construction_is_refused() -> None:
    off = WeightOffloader(1 << 20, torch.device("cpu"))
    model = toy(off)
    model.layers[1].scale = nn.Parameter(torch.ones(8))  # (as a load-time conversion might)
    with pytest.raises(ValueError, match="replaced its parameters"):
        off.activate(model)


def test_the_engine_argument(monkeypatch, caplog) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert WeightOffloadArgs(cpu_offload_gb=1.5).weight_offload_bytes(cuda) == 3 * 2**29
    assert WeightOffloadArgs().weight_offload_bytes(cuda) == 0
    assert WeightOffloadArgs(cpu_offload_gb=0).weight_offload_bytes(cpu) == 0
    with caplog.at_level(logging.WARNING):  # vLLM's CPU backend: no offload; here said so
        assert WeightOffloadArgs(cpu_offload_gb=4).weight_offload_bytes(cpu) == 0
    assert "does nothing on a CPU engine" in caplog.text
    for bad in (-1, -0.5, math.nan, math.inf, True, "4"):
        with pytest.raises(ValueError, match="cpu_offload_gb"):
            WeightOffloadArgs(cpu_offload_gb=bad).weight_offload_bytes(cuda)
    monkeypatch.setattr(WeightOffloadArgs, "offload_on_cpu", True)  # the tests' hook
    assert WeightOffloadArgs(cpu_offload_gb=0.25).weight_offload_bytes(cpu) == 2**28


def test_the_command_line_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = engine_args_from(parser.parse_args(["--cpu-offload-gb", "8"]))
    assert isinstance(args, EngineArgs) and args.cpu_offload_gb == 8.0
    assert engine_args_from(parser.parse_args([])).cpu_offload_gb == 0


def test_a_cpu_engine_ignores_the_argument_and_says_so(tiny_llama_dir, caplog) -> None:
    from shoal import LLM
    from shoal.loader.weight_offload import offloader_of

    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=64,
                  kv_cache_memory_bytes=2**20, cpu_offload_gb=4)
    try:
        assert offloader_of(llm.llm_engine.core.runner.model) is None
        assert llm.llm_engine.core.config.cache_config.cpu_offload_bytes == 0
        assert "does nothing on a CPU engine" in caplog.text
    finally:
        llm.shutdown()
