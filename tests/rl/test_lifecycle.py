"""Engines inside training loops, offline: sleep and wake give the tokens of before; a weight
update gives exactly the tokens of a fresh engine built on the new weights (dense Llama,
Qwen3-MoE, and two tensor-parallel ranks over gloo), through a state dict, a checkpoint folder
and a process group the "trainer" (this test) broadcasts into; the prefix cache never serves
blocks computed with the old weights; requests while asleep, or a lifecycle call with requests
in flight, are refused."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file

from shoal import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
PROMPTS = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": [9, 8, 7, 300]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """Two random checkpoints of one architecture and each one's tokens from a fresh engine."""

    def __init__(self, root: Path, model_type: str, **overrides):
        self.a = write_tiny_checkpoint(root / "a", model_type, seed=0, **overrides)
        self.b = write_tiny_checkpoint(root / "b", model_type, seed=1, **overrides)
        self.want = {}
        for name, path in (("a", self.a), ("b", self.b)):
            llm = LLM(model=str(path), **ENGINE)
            self.want[name] = tokens(llm)[0]
            llm.shutdown()
        assert self.want["a"] != self.want["b"]

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str((self.a if name == "a" else self.b) / "model.safetensors"))


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def pair(request, tmp_path_factory) -> Pair:
    extra = QWEN3_MOE if request.param == "qwen3_moe" else {}
    return Pair(tmp_path_factory.mktemp(request.param), request.param, **extra)


def broadcast_from_trainer(port: int, world: int, weights: dict[str, torch.Tensor]
                           ) -> threading.Thread:
    """The trainer: rank 0 of a gloo group of `world`, broadcasting each tensor in order."""

    def run() -> None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True,
                              timeout=timedelta(seconds=120))
        group = dist.ProcessGroupGloo(store, 0, world)
        for t in weights.values():
            group.broadcast(t.contiguous(), 0).wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def update_from_trainer(llm: LLM, weights: dict[str, torch.Tensor], world: int) -> None:
    """The engine's ranks (1 .. world - 1) join the trainer's group and take its broadcast."""
    port = free_port()
    trainer = broadcast_from_trainer(port, world, weights)
    llm.init_weight_update_group("127.0.0.1", port, 1, world)
    llm.update_weights_from_group(list(weights), [t.dtype for t in weights.values()],
                                  [t.shape for t in weights.values()])
    trainer.join(timeout=60)


def test_sleep_wake_and_every_update_route(pair: Pair) -> None:
    llm = LLM(model=str(pair.a), **ENGINE)
    try:
        assert tokens(llm)[0] == pair.want["a"]
        freed = llm.sleep(level=1)
        assert llm.is_sleeping() and freed["weight_bytes"] > 0 and freed["kv_cache_bytes"] > 0
        with pytest.raises(ValueError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        got, cached = tokens(llm)
        assert got == pair.want["a"] and cached == [0, 0]  # the sleep emptied the cache
        assert tokens(llm)[1][0] > 0  # and it fills again
        # a state dict: the very tokens of a fresh engine on b; nothing cached from a served
        assert llm.update_weights(pair.weights("b")) == len(pair.weights("b"))
        got, cached = tokens(llm)
        assert got == pair.want["b"] and cached == [0, 0]
        # a folder
        llm.update_weights_from_path(str(pair.a))
        assert tokens(llm)[0] == pair.want["a"]
        # level 2: the weights are dropped; they come back by an update, then the KV cache
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        assert llm.is_sleeping()  # the KV cache is still asleep
        llm.update_weights_from_path(str(pair.b))
        llm.wake_up(["kv_cache"])
        assert tokens(llm)[0] == pair.want["b"]
        update_from_trainer(llm, pair.weights("a"), world=2)  # the trainer's process group
        assert tokens(llm)[0] == pair.want["a"]
    finally:
        llm.shutdown()


def test_lifecycle_calls_need_an_idle_engine(pair: Pair) -> None:
    llm = LLM(model=str(pair.a), **ENGINE)
    try:
        llm.llm_engine.add_request("busy", PROMPTS[0], GREEDY)
        for call in (lambda: llm.sleep(1), lambda: llm.update_weights(pair.weights("b"))):
            with pytest.raises(ValueError, match="idle engine"):
                call()
        llm.llm_engine.abort_request("busy")
        while llm.llm_engine.has_unfinished_requests():  # the abort lands with a step
            llm.llm_engine.step()
        with pytest.raises(ValueError, match="sleep level"):
            llm.sleep(3)
        with pytest.raises(ValueError, match="unknown method"):
            llm.collective_rpc("__init__")
        with pytest.raises(ValueError, match="no matching parameter"):
            llm.update_weights({"model.layers.0.nonexistent.weight": torch.zeros(2)})
        llm.collective_rpc("sleep", [1])  # the engine's own sleep state follows the RPC
        assert llm.is_sleeping()
        with pytest.raises(ValueError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.collective_rpc("wake_up")
        assert not llm.is_sleeping()
        assert tokens(llm)[0] == pair.want["a"]  # nothing changed
    finally:
        llm.shutdown()


def test_two_tensor_parallel_ranks(tmp_path) -> None:
    """Each rank takes its slice of every tensor, through each route (the state dict travels
    as a shared-memory file); a bad update fails on every rank and leaves them serving."""
    pair = Pair(tmp_path, "llama")
    llm = LLM(model=str(pair.a), tensor_parallel_size=2, **ENGINE)
    try:
        llm.sleep(1)
        llm.wake_up()
        assert tokens(llm)[0] == pair.want["a"]
        llm.update_weights(pair.weights("b"))
        assert tokens(llm)[0] == pair.want["b"]
        llm.update_weights_from_path(str(pair.a))
        assert tokens(llm)[0] == pair.want["a"]
        update_from_trainer(llm, pair.weights("b"), world=3)
        assert tokens(llm)[0] == pair.want["b"]
        sums = llm.collective_rpc("weights_checksum")
        assert len(sums) == 2 and sums[0] != sums[1]  # each rank its own shard
        with pytest.raises(ValueError, match="failed on rank 0"):
            llm.update_weights_from_path(str(tmp_path / "missing"))
        assert tokens(llm)[0] == pair.want["b"]
    finally:
        llm.shutdown()


def test_shutdown_lets_go_of_the_kv_pool(tiny_llama_dir) -> None:
    """Modules a caller still holds after shutdown keep no KV pool (on a GPU it would count
    against the next engine's gpu_memory_utilization budget)."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=1 << 20)
    layers = llm.llm_engine.core.runner.model.attention_layers()
    assert all(layer.kv_cache is not None for layer in layers)
    llm.shutdown()
    assert all(layer.kv_cache is None for layer in layers)
    assert llm.llm_engine.core.runner.kv_caches == []
