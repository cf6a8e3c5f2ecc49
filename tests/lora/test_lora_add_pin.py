"""vLLM's adapter calls on the engine: add_lora (read ahead of its first request, which then
reads nothing), remove_lora, list_loras and pin_lora (never evicted from host memory nor from
its device slot, however many other adapters pass through; the scheduler runs the others in
the slots left and never deadlocks), and bad adapters refused by name while the engine serves
on. Through the offline engine, AsyncLLM (over the engine process's utility calls) and two
tensor-parallel ranks."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import msgspec
import pytest
from oracle import hf_greedy, write_tiny_checkpoint
from peft_adapters import peft_model, write_adapter, write_raw_adapter

from shoal import LLM, SamplingParams
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.core import EngineCore
from shoal.engine.core_messages import CoreOutputs, Ready, UtilityCall
from shoal.engine.core_proc import EngineCoreProc
from shoal.engine.engine_args import EngineArgs
from shoal.lora.request import LoRARequest

STEPS = 6
PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1], [9, 9, 9, 4],
           [100, 200, 300, 400, 50]]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**21)
# Projections of the tiny Llama (hidden 64, 4 heads of 16, 2 KV heads) the raw adapters adapt
TARGETS = {f"model.layers.{i}.self_attn.{p}": shape for i in range(2)
           for p, shape in (("q_proj", (64, 64)), ("v_proj", (64, 32)))}


@pytest.fixture(autouse=True)
def no_failed_steps(monkeypatch):
    """A failed step is retried request by request, which would hide a LoRA error behind
    correct outputs: none may fail."""
    seen: list[Exception] = []
    recover = EngineCore._recover

    def recording(self, error):
        seen.append(error)
        return recover(self, error)

    monkeypatch.setattr(EngineCore, "_recover", recording)
    yield
    assert not seen, f"engine steps failed: {seen}"


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny random Llama, a PEFT adapter of it (the oracle's) and four raw ones."""
    folder = tmp_path_factory.mktemp("lora-add-pin")
    base = write_tiny_checkpoint(folder / "base", "llama", seed=3)
    adapters = [write_adapter(base, folder / "a1", seed=41, r=8, targets=["q_proj", "v_proj"])]
    adapters += [write_raw_adapter(folder / f"a{i}", TARGETS, seed=40 + i, r=4, scale=0.3)
                 for i in range(2, 6)]
    return base, adapters


@pytest.fixture(scope="module")
def module_llm(family):
    llm = LLM(model=str(family[0]), enable_lora=True, max_loras=3, max_cpu_loras=3,
              max_lora_rank=8, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture
def llm(module_llm):
    """The module's engine, left without adapters by each test."""
    yield module_llm
    engine = module_llm.llm_engine
    for lora_id in engine.list_loras():
        assert engine.remove_lora(lora_id)


def lora(family, i: int) -> LoRARequest:
    """Adapter i (1..5) of the family, as id i."""
    return LoRARequest(f"adapter-{i}", i, str(family[1][i - 1]))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                          detokenize=False)


@functools.cache
def peft_tokens(base: Path, adapter: Path, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(peft_model(base, adapter), list(prompt), STEPS)[0]


def tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    outs = llm.generate(prompts, greedy(), lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def slots_of(llm: LLM):
    core = llm.llm_engine.core
    return getattr(core.runner, "driver", core.runner).lora


def test_add_lora_reads_ahead_and_list_and_remove(llm, family):
    engine, slots = llm.llm_engine, slots_of(llm)
    assert engine.list_loras() == set()
    loads = slots.loads
    assert engine.add_lora(lora(family, 1)) is True
    assert engine.list_loras() == {1} and slots.loads == loads + 1
    assert 1 in slots.slot_of  # a device slot was free: it took the adapter too
    assert engine.add_lora(lora(family, 1)) is True and slots.loads == loads + 1
    assert tokens(llm, PROMPTS[:1], lora(family, 1)) == \
        [peft_tokens(family[0], family[1][0], tuple(PROMPTS[0]))]
    assert slots.loads == loads + 1  # the first request read nothing
    assert engine.remove_lora(1) is True and engine.list_loras() == set()
    assert engine.remove_lora(1) is False  # not loaded any more


def test_pinned_adapter_survives_lru_pressure(llm, family, monkeypatch):
    """Adapter 1 pinned with three slots and three host places: four other adapters pass,
    one at a time and then all at once (two unpinned slots for four: the scheduler runs them
    in turns), and adapter 1 keeps its host copy and its slot throughout."""
    engine, slots = llm.llm_engine, slots_of(llm)
    engine.add_lora(lora(family, 1))
    assert engine.pin_lora(1) is True and engine.pin_lora(1) is True
    slot = slots.slot_of[1]
    per_step: list[tuple[int, int]] = []  # (adapters, unpinned ones) of each step
    set_step = slots.set_step

    def recording(loras, num_tokens):
        ids = {x.lora_int_id for x in loras if x is not None}
        per_step.append((len(ids), len(ids - {1})))
        set_step(loras, num_tokens)

    monkeypatch.setattr(slots, "set_step", recording)
    alone = [tokens(llm, PROMPTS[:1], lora(family, i))[0] for i in range(2, 6)]
    assert slots.slot_of[1] == slot and 1 in slots.host and len(slots.host) == 3
    loads = slots.loads
    assert tokens(llm, PROMPTS[:1], lora(family, 1)) == \
        [peft_tokens(family[0], family[1][0], tuple(PROMPTS[0]))]
    assert slots.loads == loads
    together = tokens(llm, [PROMPTS[0]] * 5, [lora(family, i) for i in range(1, 6)])
    assert together[1:] == alone and together[0] == tokens(llm, PROMPTS[:1], lora(family, 1))[0]
    assert max(n for n, _ in per_step) == 3 and max(u for _, u in per_step) == 2
    assert slots.slot_of[1] == slot and engine.list_loras() >= {1}


def test_pin_refusals_and_no_deadlock(llm, family):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="LoRA adapter 9 is not loaded"):
        engine.pin_lora(9)
    for i in (1, 2, 3, 4):
        engine.add_lora(lora(family, i))
    assert engine.pin_lora(1) and engine.pin_lora(2)
    with pytest.raises(ValueError, match=r"2 of the max_loras=3 device slots are pinned"):
        engine.pin_lora(3)  # the last unpinned slot: adapter 3's requests would wait forever
    assert engine.remove_lora(2) is True and engine.list_loras() == {1, 3, 4}
    # requests of adapters 3 and 4 run in the two unpinned slots: a second pin would leave one
    engine.add_request("r3", {"prompt_token_ids": PROMPTS[0]}, greedy(),
                       lora_request=lora(family, 3))
    engine.add_request("r4", {"prompt_token_ids": PROMPTS[1]}, greedy(),
                       lora_request=lora(family, 4))
    engine.step()
    engine.add_lora(lora(family, 2))
    with pytest.raises(ValueError, match=r"running requests use adapters \[3, 4\]"):
        engine.pin_lora(2)
    with pytest.raises(ValueError, match="in use by requests"):
        engine.add_lora(LoRARequest("other", 3, str(family[1][4])))
    assert engine.remove_lora(3) is False  # its request still runs
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_lora(lora(family, 2))  # (the running adapters' steps may have evicted it)
    assert engine.pin_lora(2) is True and engine.list_loras() >= {1, 2}
    # two slots pinned, one left: requests of two other adapters still run, in turns
    got = tokens(llm, PROMPTS[:2], [lora(family, 5), lora(family, 3)])
    assert [len(t) for t in got] == [STEPS, STEPS]


def _missing(family, folder: Path) -> Path:
    return folder / "nowhere"


BAD = {
    "missing folder": (_missing, "does not exist"),
    "rank over max_lora_rank": (lambda f, p: write_raw_adapter(p, TARGETS, seed=7, r=16),
                                r"rank 16 .*max_lora_rank \(8\)"),
    "unknown module": (lambda f, p: write_raw_adapter(
        p, {"model.layers.0.mlp.gate_up": (64, 64)}, seed=8, leaves=("gate_up",)),
        "no LoRA-capable projection"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused_by_name_and_the_engine_serves_on(case, llm, family,
                                                                tmp_path):
    make, message = BAD[case]
    engine = llm.llm_engine
    engine.add_lora(lora(family, 1))
    with pytest.raises(ValueError, match=message) as err:
        engine.add_lora(LoRARequest("bad-one", 40, str(make(family, tmp_path / "bad"))))
    assert "'bad-one' (id 40)" in str(err.value)
    assert engine.list_loras() == {1}
    assert tokens(llm, PROMPTS[:1], lora(family, 1)) == \
        [peft_tokens(family[0], family[1][0], tuple(PROMPTS[0]))]


# ---- AsyncLLM ---------------------------------------------------------------------------------
class InProcessClient:
    """The engine process's side in this process: utility calls through EngineCoreProc's
    handlers with msgpack on the way in and out (as over the socket, errors as the client
    raises them), requests into the core, outputs from its steps."""

    def __init__(self, core):
        self.core, self.proc = core, EngineCoreProc(core, None, None)
        self.dead, self.is_alive = False, True
        self.max_num_seqs = core.limits.max_num_seqs

    async def call_utility(self, method, timeout=10.0, args=None):
        wire = msgspec.msgpack.encode(UtilityCall(0, method, list(args or ())))
        result = self.proc._utility(msgspec.msgpack.decode(wire, type=UtilityCall))
        if result.error is not None:
            raise RuntimeError(result.error)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(result.result))

    def add_request(self, req):
        self.core.add_request(req)

    async def get_outputs(self):
        while not self.core.has_unfinished_requests():
            await asyncio.sleep(0.002)
        return CoreOutputs(self.core.step())

    def abort_requests(self, ids):
        self.core.abort_requests(ids)

    def on_dead(self, callback):
        pass

    def engine_of(self, request_id):
        return 0

    async def shutdown(self):
        pass


async def _async_calls(llm: LLM, family) -> None:
    core = llm.llm_engine.core
    engine = AsyncLLM(EngineArgs(model=str(family[0]), **ENGINE), InProcessClient(core),
                      Ready(core.limits, pid=0), None)
    slots = slots_of(llm)
    try:
        assert await engine.add_lora(lora(family, 1)) is True
        assert await engine.list_loras() == {1}
        assert await engine.pin_lora(1) is True
        with pytest.raises(ValueError, match="LoRA adapter 7 is not loaded"):
            await engine.pin_lora(7)
        with pytest.raises(ValueError, match="'bad' .*does not exist"):
            await engine.add_lora(LoRARequest("bad", 8, str(family[1][0] / "nowhere")))
        loads = slots.loads
        final = None
        async for out in engine.generate(PROMPTS[0], greedy(), "a1", lora_request=lora(family, 1)):
            final = out
        assert list(final.outputs[0].token_ids) == \
            peft_tokens(family[0], family[1][0], tuple(PROMPTS[0]))
        assert slots.loads == loads and slots.pinned == {1}
        assert await engine.remove_lora(1) is True and await engine.list_loras() == set()
    finally:
        await engine.shutdown()


def test_async_llm_add_list_pin_remove(llm, family):
    asyncio.run(_async_calls(llm, family))


# ---- tensor parallelism -----------------------------------------------------------------------
def test_two_tensor_parallel_ranks_add_and_pin(family):
    """add_lora reads the adapter on both ranks (gloo) before any request; pin and a bad
    adapter go the same way, and the ranks serve on with the first request reading nothing."""
    llm = LLM(model=str(family[0]), enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=2, **ENGINE)
    try:
        engine, slots = llm.llm_engine, slots_of(llm)
        assert engine.add_lora(lora(family, 1)) is True and engine.pin_lora(1) is True
        with pytest.raises(ValueError, match="'bad' .*does not exist"):
            engine.add_lora(LoRARequest("bad", 8, str(family[1][0] / "nowhere")))
        ranks = llm.collective_rpc("rank_info")
        assert [r["lora_adapters"] for r in ranks] == [[1], [1]]
        loads = slots.loads
        got = tokens(llm, PROMPTS[:2], [lora(family, 1), lora(family, 1)])
        assert slots.loads == loads and engine.list_loras() == {1}
        assert got == [peft_tokens(family[0], family[1][0], tuple(p)) for p in PROMPTS[:2]]
    finally:
        llm.shutdown()
