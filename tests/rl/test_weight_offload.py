"""Weight offloading (cpu_offload_gb) through the engine, run on the CPU through the tests' hook
(WeightOffloadArgs.offload_on_cpu: the mechanism is device-generic; the argument itself does
nothing on a CPU engine): with the first layers' weights kept apart and copied into the
staging buffer before each of them, greedy tokens and logprobs are exactly the plain
engine's, on a dense Llama and a Qwen3-MoE whose layers differ in size; sleep and wake keep
them; weight updates (state dict, folder, level-2 sleep then folder) land in the host copies
and give the tokens of a fresh engine on the new weights; two tensor-parallel ranks each
offload within their own budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from shoal.engine.offload_args import WeightOffloadArgs
from shoal.loader.weight_offload import layer_layout, offloader_of

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
PROMPTS = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": [9, 8, 7, 300]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(autouse=True)
def offload_on_cpu(monkeypatch) -> None:
    monkeypatch.setattr(WeightOffloadArgs, "offload_on_cpu", True)


def outputs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's greedy tokens and top logprobs."""
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def tokens(llm: LLM) -> list[list[int]]:
    return [t for t, _ in outputs(llm)]


class Plain:
    """Two random checkpoints, a fresh engine's outputs on each, its weights' checksum, and
    the bytes of each decoder layer's parameters (one rank)."""

    def __init__(self, root: Path, model_type: str, **overrides):
        self.a = write_tiny_checkpoint(root / "a", model_type, seed=0, **overrides)
        self.b = write_tiny_checkpoint(root / "b", model_type, seed=1, **overrides)
        llm = LLM(model=str(self.a), **ENGINE)
        self.want_a, self.checksum_a = outputs(llm), llm.collective_rpc("weights_checksum")
        model = llm.llm_engine.core.runner.model
        self.layer_bytes = [layer_layout(list(layer.parameters()))[1]
                            for layer in model.model.layers]
        llm.shutdown()
        llm = LLM(model=str(self.b), **ENGINE)
        self.want_b = outputs(llm)
        llm.shutdown()
        assert tokens_of(self.want_a) != tokens_of(self.want_b)

    def weights(self, which: str) -> dict[str, torch.Tensor]:
        return load_file(str((self.a if which == "a" else self.b) / "model.safetensors"))


def tokens_of(outs: list) -> list[list[int]]:
    return [t for t, _ in outs]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def plain(request, tmp_path_factory) -> Plain:
    extra = QWEN3_MOE if request.param == "qwen3_moe" else dict(num_hidden_layers=4)
    return Plain(tmp_path_factory.mktemp(request.param), request.param, **extra)


def test_offloaded_engine_matches_through_sleep_and_updates(plain: Plain) -> None:
    sizes = plain.layer_bytes
    budget = sizes[0] + sizes[1] + sizes[2] - 1  # two whole layers fit, not the third
    llm = LLM(model=str(plain.a), cpu_offload_gb=budget / 2**30, **ENGINE)
    try:
        runner = llm.llm_engine.core.runner
        offloader = offloader_of(runner.model)
        assert offloader is not None and offloader.staging is not None
        stats = offloader.stats
        assert stats.layers == ("model.layers.0", "model.layers.1")
        assert stats.offloaded_bytes == sizes[0] + sizes[1] <= budget
        assert stats.staging_bytes == max(sizes[0], sizes[1])
        info = llm.collective_rpc("rank_info")[0]
        assert info["offloaded_layers"] == list(stats.layers)
        # the offloaded layers really read the shared staging buffer (the same bytes)
        lo = offloader.staging.data_ptr()
        layers = runner.model.model.layers
        for i in (0, 1):
            for p in layers[i].parameters():
                assert lo <= p.data_ptr() < lo + offloader.staging.numel()
        first = [layers[i].self_attn.qkv_proj.weight.data_ptr() for i in (0, 1)]
        assert first == [lo, lo]  # (each layer's first parameter at the buffer's start)
        assert outputs(llm) == plain.want_a  # tokens and logprobs, exactly
        assert llm.collective_rpc("weights_checksum") == plain.checksum_a
        llm.sleep(level=1)
        llm.wake_up()
        assert outputs(llm) == plain.want_a
        # updates land in the host copies of the offloaded layers
        assert llm.update_weights(plain.weights("b")) == len(plain.weights("b"))
        assert outputs(llm) == plain.want_b
        llm.update_weights_from_path(str(plain.a))
        assert outputs(llm) == plain.want_a
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.update_weights_from_path(str(plain.b))
        llm.wake_up(["kv_cache"])
        assert outputs(llm) == plain.want_b
    finally:
        llm.shutdown()


def test_every_layer_offloaded(plain: Plain) -> None:
    """A budget past the whole stack offloads every decoder layer (and no more bytes)."""
    llm = LLM(model=str(plain.a), cpu_offload_gb=1.0, **ENGINE)
    try:
        stats = offloader_of(llm.llm_engine.core.runner.model).stats
        assert len(stats.layers) == len(plain.layer_bytes)
        assert stats.offloaded_bytes == sum(plain.layer_bytes)
        assert outputs(llm) == plain.want_a
    finally:
        llm.shutdown()


def test_two_tensor_parallel_ranks_offload_their_own_shards(tmp_path) -> None:
    plain = Plain(tmp_path, "llama", num_hidden_layers=4)
    # The budget is per rank: a rank's shard of a layer is a little over half of it (the
    # norms are whole), so 1.5 layers' bytes hold two shards, where one rank would hold one.
    budget = int(1.5 * plain.layer_bytes[0])
    llm = LLM(model=str(plain.a), tensor_parallel_size=2, cpu_offload_gb=budget / 2**30,
              **ENGINE)
    try:
        infos = llm.collective_rpc("rank_info")
        assert len(infos) == 2
        for info in infos:
            assert info["offloaded_layers"] == ["model.layers.0", "model.layers.1"]
            assert plain.layer_bytes[0] < info["offloaded_bytes"] <= budget
        assert tokens(llm) == tokens_of(plain.want_a)
        llm.update_weights(plain.weights("b"))
        assert tokens(llm) == tokens_of(plain.want_b)
        llm.sleep(1)
        llm.wake_up()
        assert tokens(llm) == tokens_of(plain.want_b)
    finally:
        llm.shutdown()
