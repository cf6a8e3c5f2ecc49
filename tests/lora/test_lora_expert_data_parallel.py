"""LoRA on the MoE experts under DP+EP (shoal/lora/shared_expert_slots.py): two replicas, each
with half the experts and one adapter slot of its own, serve two expert adapters and the base
model in one batch and give the one-rank engine's greedy tokens and logprobs. Replica 0's
requests of adapter "experts" reach replica 1's experts, where no request of replica 1 names
that adapter: replica 1 loads it into the shared table all the same. A later round brings a
third adapter, which takes the least recently used shared slot on both replicas. And
replicas whose LoRA settings differ are refused when they join."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.lora.request import LoRARequest
from shoal.lora.shared_expert_slots import check_same_lora_settings, lora_settings

QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
HIDDEN, INTER, EXPERTS = 64, 24, 8
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22,
              enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)
STEPS = 6
# (replica, prompt, adapter) of round one, then round two ("third" evicts one of the others)
ROUND_ONE = [(0, [5, 17, 300, 42, 7, 99], "experts"), (0, [9, 9, 9], None),
             (0, [100, 200, 300, 400, 500, 60, 70], "experts"),
             (1, [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], "stacked"),
             (1, [33, 44, 55, 66, 77], "stacked"), (1, [1, 2, 3, 4], None)]
ROUND_TWO = [(0, [12, 13, 14, 15, 16], "third"), (1, [7, 70, 170, 7, 70], "experts")]
IDS = {"experts": 1, "stacked": 2, "third": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "bias": "none", "task_type": "CAUSAL_LM", **config}))
    return path


def _per_expert(path: Path, seed: int, r: int = 4) -> Path:
    """PEFT's per-expert layout (gate/up/down of every expert of both MoE layers)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
              "down_proj": (INTER, HIDDEN)}
    tensors = {}
    for layer in (0, 2):
        for e in range(EXPERTS):
            for proj, (n_in, n_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * 0.3
    return _write(path, tensors, {"r": r, "lora_alpha": 8, "target_modules": sorted(shapes)})


def _stacked_down(path: Path, seed: int, r: int = 8) -> Path:
    """PEFT's target_parameters layout over the stacked down_proj of both MoE layers (A
    [E * r, I], B [H, E * r]), beside a q_proj adapter of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(3):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(r, HIDDEN, generator=gen) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn(64, r, generator=gen) * 0.1
    for layer in (0, 2):
        key = f"base_model.model.model.layers.{layer}.mlp.experts"
        tensors[f"{key}.lora_A.weight"] = torch.randn(EXPERTS * r, INTER, generator=gen) * 0.3
        tensors[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, EXPERTS * r, generator=gen) * 0.3
    return _write(path, tensors, {"r": r, "lora_alpha": 16, "target_modules": ["q_proj"],
                                  "target_parameters": ["mlp.experts.down_proj"]})


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-experts-dpep")
    base = write_tiny_checkpoint(folder / "base", "qwen3_moe", seed=5, **QWEN3_MOE)
    adapters = {"experts": _per_expert(folder / "experts", seed=71),
                "stacked": _stacked_down(folder / "stacked", seed=72),
                "third": _per_expert(folder / "third", seed=73)}
    return base, adapters


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)


def _request(adapters: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, IDS[name], str(adapters[name]))


def _results(outs) -> list[tuple[list[int], list[float]]]:
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.fixture(scope="module")
def one_rank(moe):
    """Every request of both rounds on one rank (two slots: every expert local), and each
    prompt under the base model too."""
    base, adapters = moe
    cases = ROUND_ONE + ROUND_TWO
    llm = LLM(model=str(base), max_loras=2, **ENGINE)
    try:
        prompts = [p for _, p, _ in cases] * 2
        loras = [_request(adapters, n) for _, _, n in cases] + [None] * len(cases)
        got = _results(llm.generate(prompts, _greedy(), lora_request=loras, use_tqdm=False))
    finally:
        llm.shutdown()
    return got[:len(cases)], got[len(cases):]


def _replica(rank: int, port: int, base: str, adapters: dict[str, Path], out: str) -> None:
    torch.set_num_threads(1)
    llm = LLM(model=base, max_loras=1, data_parallel_size=2, enable_expert_parallel=True,
              data_parallel_rank=rank, data_parallel_master_port=port, **ENGINE)
    try:
        from shoal.layers.moe.layer import FusedMoE

        runner = llm.llm_engine.core.runner
        slots = getattr(runner, "driver", runner).lora
        received: set[int] = set()  # the shared slots of the rows dispatched to this replica
        run_local = FusedMoE._run_local_experts

        def record(self, x, local_ids, lora_slots=None):
            if lora_slots is not None:
                received.update(lora_slots.tolist())
            return run_local(self, x, local_ids, lora_slots)

        FusedMoE._run_local_experts = record
        result: dict = {"slots": slots.expert_layers[0].a13.shape[:2]}
        for name, cases in (("one", ROUND_ONE), ("two", ROUND_TWO)):
            mine = [(p, n) for r, p, n in cases if r == rank]
            outs = llm.generate([p for p, _ in mine], _greedy(), use_tqdm=False,
                                lora_request=[_request(adapters, n) for _, n in mine])
            result[name] = _results(outs)
            result[f"table_{name}"] = {key[0]: slot for key, slot in slots.shared.slot_of.items()}
            result[f"received_{name}"] = sorted(received)
            received.clear()
        torch.save(result, out)
    finally:
        llm.shutdown()
    os._exit(0)  # (an exception above exits non-zero, with no result written)


def _assert_same(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lp), (_, ref) in zip(got, expected):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-4, rtol=0)


def test_two_replicas_serve_expert_adapters_as_one_rank(moe, one_rank, tmp_path):
    base, adapters = moe
    reference, base_model = one_rank
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    procs = [ctx.Process(target=_replica, args=(r, port, str(base), adapters, outs[r]))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    results = [torch.load(o, weights_only=False) for o in outs]
    # each replica: 4 of the 8 experts, in data_parallel_size x max_loras = 2 shared slots
    assert all(tuple(r["slots"]) == (2, 4) for r in results)
    cases = ROUND_ONE + ROUND_TWO
    for name, round_cases, offset in (("one", ROUND_ONE, 0), ("two", ROUND_TWO, len(ROUND_ONE))):
        for rank in range(2):
            idx = [offset + i for i, (r, _, _) in enumerate(round_cases) if r == rank]
            _assert_same(results[rank][name], [reference[i] for i in idx])
    # the adapters matter: each adapter request's answer is far from the base model's
    for i, (_, _, adapter) in enumerate(cases):
        (tokens, lps), (base_tokens, base_lps) = reference[i], base_model[i]
        if adapter is not None:
            assert tokens != base_tokens or max(
                abs(a - b) for a, b in zip(lps, base_lps)) > 0.05, adapter
    # the replicas agree on the table; replica 1 held "experts" for replica 0's tokens and
    # applied it to rows dispatched to it, as replica 0 did "stacked" for replica 1's
    one = [r["table_one"] for r in results]
    assert one[0] == one[1] and set(one[0]) == {IDS["experts"], IDS["stacked"]}
    assert one[0][IDS["experts"]] in results[1]["received_one"]
    assert one[0][IDS["stacked"]] in results[0]["received_one"]
    # round two: "third" took the slot of "stacked" (least recently used, needed by no step)
    two = [r["table_two"] for r in results]
    assert two[0] == two[1] == {IDS["experts"]: one[0][IDS["experts"]],
                                IDS["third"]: one[0][IDS["stacked"]]}


def test_replicas_with_other_lora_settings_are_refused():
    same = lora_settings(None)
    check_same_lora_settings([same, same])
    from shoal.config.lora import LoRAConfig

    one, two = LoRAConfig(max_loras=1), LoRAConfig(max_loras=2)
    check_same_lora_settings([lora_settings(one), lora_settings(LoRAConfig(max_loras=1))])
    with pytest.raises(ValueError, match=r"replica 0: enable_lora=True, max_loras=1.*"
                                         r"replica 1: enable_lora=True, max_loras=2"):
        check_same_lora_settings([lora_settings(one), lora_settings(two)])
    with pytest.raises(ValueError, match=r"replica 1: enable_lora=False;"):
        check_same_lora_settings([lora_settings(one), lora_settings(None), lora_settings(one)])
