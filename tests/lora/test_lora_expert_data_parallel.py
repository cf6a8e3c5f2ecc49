"""LoRA on the MoE experts under DP+EP (shoal/lora/shared_expert_slots.py): two replicas, each
with half the experts and one adapter slot of its own, serve two expert adapters and the base
model in one batch and give the one-rank engine's greedy tokens and logprobs. Replica 0's
requests of adapter "experts" reach replica 1's experts, where no request of replica 1 names
that adapter: replica 1 loads it into the shared table all the same. A later round brings a
third adapter, which takes the least recently used shared slot on both replicas. Over a
round's decode steps, whose adapters stay the same, the replicas exchange their adapter sets
once, not at every step. A third round serves one adapter id at two versions of its files,
one of them gone from disk by then: only the requests naming that version fail, on the
replica that has them, and the rest give the one-rank tokens. And replicas whose LoRA
settings differ are refused when they join."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.lora.adapter import read_adapter
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
# Round three: adapter "versioned" (id 4) in one folder, saved first with the files of
# "experts" (version A), then with those of "third" (version B) once replica 0 holds A in
# memory and has a request of it; replica 1's request, added then, names B and equals "third"
# on its prompt (ROUND_TWO). Adapter "resaved" (id 5) is saved again once replica 0 has a
# request of it, before replica 0 reads it (its second step: the one slot is A's first).
# (replica, prompt, adapter or None, max_tokens); replica 0 is idle after two steps and runs
# dummy passes while replica 1 decodes.
ROUND_THREE = [(0, ROUND_ONE[0][1], "versioned", STEPS), (0, ROUND_ONE[1][1], None, 2),
               (0, ROUND_ONE[3][1], "resaved", STEPS), (1, ROUND_TWO[0][1], "versioned", STEPS),
               (1, ROUND_ONE[5][1], None, STEPS)]
THREE_IDS = {"versioned": 4, "resaved": 5}
THREE_REFERENCE = [None, 1, None, len(ROUND_ONE), 5]  # index in the one-rank results


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


def _greedy(max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


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


def _save_as(folder: Path, source: Path) -> None:
    """The adapter folder saved again with `source`'s files (each replaced whole)."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(source / name, folder / f"{name}.new")
        os.replace(folder / f"{name}.new", folder / name)


def _round_three(llm, rank: int, adapters: dict[str, Path], folders: dict[str, Path],
                 marker: Path) -> list:
    """Replica 0 holds version A of "versioned" in memory and adds its requests; both folders
    are then saved again, and replica 1 adds its own (keyed to B). Then both step until every
    replica is idle. Each request's (error, result), in ROUND_THREE's order of this replica."""
    eng = llm.llm_engine
    loras = {n: LoRARequest(n, i, str(folders[n])) for n, i in THREE_IDS.items()}
    if rank == 1:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("replica 0 did not add its round-three requests")
            time.sleep(0.01)
    else:
        eng.add_lora(loras["versioned"])  # version A into host memory
    ids = []
    for r, prompt, name, max_tokens in ROUND_THREE:
        if r == rank:
            ids.append(eng.next_request_id())
            eng.add_request(ids[-1], prompt, _greedy(max_tokens),
                            lora_request=None if name is None else loras[name])
    if rank == 0:
        _save_as(folders["versioned"], adapters["third"])  # version A is gone from disk
        _save_as(folders["resaved"], adapters["experts"])
        marker.touch()
    eng.join_replicas()
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [(o.error, _results([o])[0] if o.error is None else None)
            for o in (done[i] for i in ids)]


def _replica(rank: int, port: int, base: str, adapters: dict[str, Path], out: str,
             folders: dict[str, Path], marker: str) -> None:
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
        gathers = [0]  # every all_gather_object of this replica (the shared slots' exchanges)
        gather = torch.distributed.all_gather_object

        def count(*args, **kwargs):
            gathers[0] += 1
            return gather(*args, **kwargs)

        torch.distributed.all_gather_object = count
        lockstep = llm.llm_engine.core.dp_lockstep
        result: dict = {"slots": slots.expert_layers[0].a13.shape[:2]}
        for name, cases in (("one", ROUND_ONE), ("two", ROUND_TWO)):
            mine = [(p, n) for r, p, n in cases if r == rank]
            gathers[0], forwards = 0, runner.num_forwards + lockstep.dummy_steps
            outs = llm.generate([p for p, _ in mine], _greedy(), use_tqdm=False,
                                lora_request=[_request(adapters, n) for _, n in mine])
            result[name] = _results(outs)
            result[f"passes_{name}"] = runner.num_forwards + lockstep.dummy_steps - forwards
            result[f"gathers_{name}"] = gathers[0]
            result[f"table_{name}"] = {key[0]: slot for key, slot in slots.shared.slot_of.items()}
            result[f"received_{name}"] = sorted(received)
            received.clear()
        gathers[0], dummies = 0, lockstep.dummy_steps
        result["three"] = _round_three(llm, rank, adapters, folders, Path(marker))
        result["gathers_three"] = gathers[0]
        result["dummies_three"] = lockstep.dummy_steps - dummies
        result["table_three"] = {(key[0], key[2]): slot
                                 for key, slot in slots.shared.slot_of.items()}
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
    folders = {n: tmp_path / n for n in THREE_IDS}  # round three's adapters, first saved as
    for name, source in (("versioned", "experts"), ("resaved", "stacked")):
        folders[name].mkdir()
        _save_as(folders[name], adapters[source])
    marker = str(tmp_path / "round-three-added")
    procs = [ctx.Process(target=_replica, args=(r, port, str(base), adapters, outs[r],
                                                folders, marker))
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
    # the adapter sets are exchanged when they change, not at every forward pass: only at a
    # round's first step (the sets, then the loads' outcome); the others' sets stay the same
    for r in results:
        for name in ("one", "two"):
            assert r[f"passes_{name}"] >= STEPS and r[f"gathers_{name}"] == 2, r
    # round three: the request of version A fails (replica 1 could not load A's expert
    # slices, its files gone), and so does that of "resaved" (replica 0 could not load it
    # itself), each with the reason; every other request gives one rank's answer
    per_replica = [iter(r["three"]) for r in results]
    three = [next(per_replica[case[0]]) for case in ROUND_THREE]
    failures = {0: "DP+EP replica 1 could not load the expert slices of LoRA adapter "
                   "'versioned' (id 4)",
                2: "DP+EP replica 0 could not load LoRA adapter 'resaved' (id 5)"}
    for i, ((error, got), ref, case) in enumerate(zip(three, THREE_REFERENCE, ROUND_THREE)):
        if i in failures:
            assert error is not None and failures[i] in error, error
            assert "its files changed after the request arrived" in error, error
            continue
        assert error is None, error
        n = case[3]
        _assert_same([got], [(reference[ref][0][:n], reference[ref][1][:n])])
    # replica 0, idle after two steps, ran dummy passes in step with replica 1 (whose tokens
    # of B still met B on replica 0's experts). Sets exchanged: step one (and the loads'
    # outcome), two ("resaved" instead of A on replica 0), three (replica 0 idle); no more
    assert results[0]["dummies_three"] == STEPS - 2, results[0]["dummies_three"]
    assert [r["gathers_three"] for r in results] == [4, 4]
    # both replicas' tables: version B kept its slot; A and "resaved" have none
    b = read_adapter(str(adapters["third"])).digest
    tables = [r["table_three"] for r in results]
    assert tables[0] == tables[1]
    assert [key for key in tables[0] if key[0] in THREE_IDS.values()] == [(4, b)]


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
