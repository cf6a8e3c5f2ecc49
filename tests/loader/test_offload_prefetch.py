"""Weight offloading with prefetch (shoal/loader/offload_copies.py), run on the CPU where a copy
is synchronous but the slot schedule is the one CUDA runs: two staging slots, layer k in slot
k % 2; when layer k runs, its own weights are in its slot and layer k+1's are already in the
other; each layer is copied once per forward; a layer run out of order still gets its
weights; the CPU default stays one slot without prefetch. Through the engine: the plain
engine's tokens and logprobs, through sleep, wake-up and an update, and a level-1 sleep that
keeps no host copy of the staging buffer. (Tokens with and without prefetch on CUDA:
tests/rl/test_weight_copies_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file
from torch import nn

from shoal import LLM, SamplingParams
from shoal.engine.offload_args import WeightOffloadArgs
from shoal.layers.attention import Attention
from shoal.loader.weight_offload import WeightOffloader, layer_layout, offloader_of
from shoal.worker.sleep_mode import kept_sizes


class ToyLayer(nn.Module):
    """A decoder layer to the offloader (it holds a paged Attention, unused here)."""

    def __init__(self, width: int, extra: int):
        super().__init__()
        self.attn = Attention(2, 2, 4)
        self.proj = nn.Linear(width, width)
        self.extra = nn.Parameter(torch.randn(extra))  # makes the layers' sizes differ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) + self.extra.mean()


class Toy(nn.Module):
    def __init__(self, extras: tuple[int, ...] = (40, 400, 40, 40, 40)):
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(8, e) for e in extras)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def toy(offloader: WeightOffloader | None = None) -> Toy:
    torch.manual_seed(0)
    if offloader is None:
        return Toy()
    with offloader.building():
        return Toy()


def test_prefetch_alternates_two_slots_and_copies_the_next_layer_first() -> None:
    ref = toy()
    sizes = [layer_layout(list(layer.parameters()))[1] for layer in ref.layers]
    off = WeightOffloader(sum(sizes[:4]), torch.device("cpu"), prefetch=True)
    model = toy(off)
    stats = off.activate(model)
    assert len(stats.layers) == 4 and stats.staging_bytes == 2 * max(sizes[:4])
    assert off.staging is not None and off.copies is not None
    slot = max(sizes[:4])
    base = off.staging.data_ptr()
    for k in range(4):  # layer k's first parameter at the head of slot k % 2
        assert next(model.layers[k].parameters()).data_ptr() == base + (k % 2) * slot
    seen = []

    def check(k: int):  # noqa: ANN202 (runs after the offloader's pre-hook of layer k)
        def hook(module: nn.Module, args: tuple) -> None:
            held = [torch.equal(off.layers[j].staging_used, off.layers[j].home)
                    for j in (k, k + 1) if j < 4]
            seen.append((k, held))
        return hook
    for k in range(4):
        model.layers[k].register_forward_pre_hook(check(k))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))
        assert seen == [(0, [True, True]), (1, [True, True]), (2, [True, True]), (3, [True])]
        assert off.copies.issued == 4  # once per layer, the prefetched ones not again
        assert torch.equal(model(x), ref(x))
        assert off.copies.issued == 8
        # out of order: layer 2 alone (nothing prefetched for it), then layer 1 after the
        # others ran, its slot overwritten by layer 3's weights: both copied on the spot
        assert torch.equal(model.layers[2](x), ref.layers[2](x))
        assert torch.equal(model.layers[1](x), ref.layers[1](x))
        assert torch.equal(model(x), ref(x))


def test_the_cpu_default_is_one_slot_without_prefetch(monkeypatch) -> None:
    off = WeightOffloader(1 << 20, torch.device("cpu"))
    model = toy(off)
    stats = off.activate(model)
    assert not off.prefetch and off.copies is not None and not off.copies.prefetch
    assert stats.staging_bytes == max(layer_layout(list(layer.parameters()))[1]
                                      for layer in model.layers)
    # CUDA: prefetch behind SHOAL_OFFLOAD_PREFETCH until its GPU test has passed there
    assert not WeightOffloader(1, torch.device("cuda")).prefetch  # (built only)
    monkeypatch.setenv("SHOAL_OFFLOAD_PREFETCH", "1")
    assert WeightOffloader(1, torch.device("cuda")).prefetch
    assert not WeightOffloader(1, torch.device("cpu")).prefetch
    one = WeightOffloader(1 << 20, torch.device("cpu"), prefetch=True)
    single = nn.ModuleList()
    with one.building():
        single.append(ToyLayer(8, 4))
    one.activate(single)
    assert not one.copies.prefetch  # one layer: nothing to prefetch, one slot
    assert one.stats.staging_bytes == layer_layout(list(single[0].parameters()))[1]


ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
PROMPTS = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": [9, 8, 7, 300]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def outputs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def test_engine_with_prefetch_matches_the_plain_one(tmp_path, monkeypatch) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", "llama", seed=0, num_hidden_layers=4)
    b = write_tiny_checkpoint(tmp_path / "b", "llama", seed=1, num_hidden_layers=4)
    want = {}
    for name, path in (("a", a), ("b", b)):
        plain = LLM(model=str(path), **ENGINE)
        want[name] = outputs(plain)
        plain.shutdown()
    monkeypatch.setattr(WeightOffloadArgs, "offload_on_cpu", True)
    monkeypatch.setattr(WeightOffloader, "default_prefetch", True)
    llm = LLM(model=str(a), cpu_offload_gb=1.0, **ENGINE)  # every layer offloaded
    try:
        runner = llm.llm_engine.core.runner
        off = offloader_of(runner.model)
        assert off.prefetch and len(off.stats.layers) == 4
        assert outputs(llm) == want["a"]  # tokens and logprobs, exactly
        every = sum(kept_sizes([runner.model]))
        llm.sleep(1)
        # the sleep kept the bytes of every storage but the staging buffer's (they do not
        # matter: each forward copies the layers in)
        assert runner.host_copies.nbytes == every - off.staging.numel() > 0
        llm.wake_up()
        assert outputs(llm) == want["a"]
        llm.update_weights(load_file(str(b / "model.safetensors")))
        assert outputs(llm) == want["b"]
        assert off.copies.issued > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_flag_reaches_the_engine(tiny_llama_dir, monkeypatch, prefetch) -> None:
    monkeypatch.setattr(WeightOffloadArgs, "offload_on_cpu", True)
    monkeypatch.setattr(WeightOffloader, "default_prefetch", prefetch)
    llm = LLM(model=str(tiny_llama_dir), cpu_offload_gb=1.0, **ENGINE)
    try:
        off = offloader_of(llm.llm_engine.core.runner.model)
        slot = max(layer_layout(list(layer.parameters()))[1]
                   for layer in llm.llm_engine.core.runner.model.model.layers)
        assert off.prefetch is prefetch
        assert off.stats.staging_bytes == (2 if prefetch else 1) * slot
    finally:
        llm.shutdown()
