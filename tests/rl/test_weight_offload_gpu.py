"""Weight offloading on a real GPU (skipped without one), CUDA graphs on: device memory drops
by about the offloaded bytes less the staging buffer (the CUDA allocator's figures), that
memory goes to the KV cache, and greedy tokens and logprobs equal the plain engine's before
and after a sleep / wake and a weight update."""

from __future__ import annotations

import gc

import pytest
import torch
from bf16_runs import greedy_outputs, same
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from shoal.loader.weight_offload import WeightOffloader, layer_layout, offloader_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# ~34 MB of bfloat16 weights a layer: what offloading moves shows above the noise.
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
             max_position_embeddings=1024)
ENGINE = dict(dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3)
PROMPTS = [{"prompt_token_ids": list(range(5, 69))}, {"prompt_token_ids": [9, 8, 7, 300]}]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
MiB = 2**20


def outputs(llm: LLM) -> list[tuple[list[int], list[list[float]]]]:
    return greedy_outputs(llm, PROMPTS, GREEDY)


def baseline() -> dict[str, int]:
    """What the allocator holds before an engine starts (anything an earlier one left), less
    torch's cuBLAS workspaces. torch keeps one per (cuBLAS handle, stream) for the life of
    the process, 32 MiB each on Hopper: the first engine allocates the default stream's (its
    profile run) and the graph capture stream's (graph_table.capture_stream), and a later
    engine would reuse both, so its figures would show 64 MiB less than the first's without
    offloading having saved it. Freed here, each engine allocates and counts its own. (Not
    at shutdown: engines alive in one process share those workspaces, and their captured
    graphs hold the addresses.)"""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()  # (their blocks leave "reserved" too, which the KV sizing reads)
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def measure(llm: LLM, base: dict[str, int]) -> dict[str, int]:
    """Device bytes the engine's allocations hold, split into the KV cache and the rest."""
    runner = llm.llm_engine.core.runner
    torch.cuda.synchronize()
    # the layers' caches are views of one pool: count each storage once
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in runner.kv_caches}
    kv = sum(storages.values())
    return {"kv": kv, "rest": torch.cuda.memory_allocated() - base["allocated"] - kv}


def close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("prefetch", [False, True])
def test_offload_frees_device_memory_for_the_kv_cache_and_keeps_tokens(
        tmp_path, monkeypatch, prefetch: bool) -> None:
    """prefetch: layer k+1 copied on a side stream into a second staging slot while layer k
    runs (off by default until this passes on a GPU): the same tokens, the second slot
    counted in what offloading saves."""
    monkeypatch.setattr(WeightOffloader, "default_prefetch", prefetch)
    path = str(write_tiny_checkpoint(tmp_path / "m", "llama", **SHAPE))
    updated = {k: v * 1.5 if v.dim() == 2 else v
               for k, v in load_file(f"{path}/model.safetensors").items()}
    # A first engine pays once for what the process keeps after it (cuBLAS/cuBLASLt state,
    # launchers): measured, the plain engine would carry it and the offloaded one reuse it
    # (69 MB of KV sizing apart on an H100, beyond the workspaces baseline() clears).
    close(LLM(model=path, **ENGINE))
    plain_base = baseline()
    plain = LLM(model=path, **ENGINE)
    want = outputs(plain)
    layers = plain.llm_engine.core.runner.model.model.layers
    sizes = [layer_layout(list(layer.parameters()))[1] for layer in layers]
    plain_mem = measure(plain, plain_base)
    plain.update_weights(updated)
    want_updated = outputs(plain)
    close(plain)
    assert not same(want, want_updated)

    budget = sum(sizes[:4]) + sizes[4] // 2  # four whole layers, never a fifth
    base = baseline()
    llm = LLM(model=path, cpu_offload_gb=budget / 2**30, **ENGINE)
    try:
        offloader = offloader_of(llm.llm_engine.core.runner.model)
        assert offloader.prefetch is prefetch
        stats = offloader.stats
        assert stats.layers == tuple(f"model.layers.{i}" for i in range(4))
        assert stats.offloaded_bytes == sum(sizes[:4]) <= budget
        saved = stats.offloaded_bytes - stats.staging_bytes
        mem = measure(llm, base)
        # the weights' device memory drops by what offloading saves ...
        assert abs((plain_mem["rest"] - mem["rest"]) - saved) <= 0.1 * saved + 8 * MiB
        # ... and the KV cache sizing hands it to the pool (less what the plain engine left
        # reserved, which the sizing counts as used)
        left = base["reserved"] - plain_base["reserved"]
        assert abs((mem["kv"] - plain_mem["kv"]) - (saved - left)) <= 0.1 * saved + 16 * MiB
        assert llm.llm_engine.core.runner.graphs is not None  # replays copy the layers in
        assert same(outputs(llm), want)
        llm.sleep(level=1)
        llm.wake_up()
        assert same(outputs(llm), want)
        llm.update_weights(updated)
        assert same(outputs(llm), want_updated)
    finally:
        close(llm)


def test_dummy_weights_are_the_same_offloaded_or_not(tmp_path) -> None:
    """load_format="dummy" draws an offloaded layer's values on the device too."""
    path = str(write_tiny_checkpoint(tmp_path / "m", "llama", num_hidden_layers=4))
    kw = dict(ENGINE, load_format="dummy", dtype="float32")
    plain = LLM(model=path, **kw)
    checksum = plain.collective_rpc("weights_checksum")
    want = [t for t, _ in outputs(plain)]
    close(plain)
    llm = LLM(model=path, cpu_offload_gb=1.0, **kw)
    try:
        assert len(offloader_of(llm.llm_engine.core.runner.model).stats.layers) == 4
        # (float64 sums, on the host for the offloaded layers: equal to rounding)
        assert llm.collective_rpc("weights_checksum") == pytest.approx(checksum, rel=1e-9)
        assert [t for t, _ in outputs(llm)] == want
    finally:
        close(llm)
