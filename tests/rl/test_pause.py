"""Generation paused and resumed around a weight update, offline (engine/pause.py): a pause
aborts the requests in flight, or lets them finish; requests added while paused wait and then
give the tokens of an engine never paused; update_weights runs while paused, and the held
requests then give the new weights' tokens; generate while paused is refused."""

from __future__ import annotations

import pytest
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from shoal.core.scheduler_output import SchedulerOutput

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
PROMPTS = [list(range(5, 45)), [9, 8, 7, 300]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pause")
    a = write_tiny_checkpoint(root / "a", "llama", seed=0)
    b = write_tiny_checkpoint(root / "b", "llama", seed=1)
    want = {}
    for name, path in (("b", b), ("a", a)):
        llm = LLM(model=str(path), **ENGINE)
        want[name] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
        if name == "b":
            llm.shutdown()
    yield llm, want, load_file(str(b / "model.safetensors")), load_file(
        str(a / "model.safetensors"))
    llm.shutdown()


def add(llm: LLM, rid: str, prompt: list[int]) -> None:
    llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)


def step_all(llm: LLM, limit: int = 100) -> dict:
    """Steps while the engine has work; the finished outputs by id."""
    done = {}
    for _ in range(limit):
        if not llm.llm_engine.core.has_unfinished_requests():
            break
        done |= {o.request_id: o.outputs[0] for o in llm.llm_engine.step() if o.finished}
    return done


def test_pause_aborts_in_flight_and_held_requests_run_after_resume(setup) -> None:
    llm, want, _, _ = setup
    core = llm.llm_engine.core
    add(llm, "x0", PROMPTS[0])
    add(llm, "x1", PROMPTS[1])
    for _ in range(3):
        llm.llm_engine.step()
    assert len(core.scheduler.running) == 2
    core.pause_generation(wait_for_inflight_requests=False)
    assert llm.is_paused()
    done = step_all(llm)
    assert {rid: o.finish_reason for rid, o in done.items()} == {"x0": "abort", "x1": "abort"}
    add(llm, "late", PROMPTS[0])
    assert step_all(llm) == {}  # held: no work
    assert not core.has_unfinished_requests() and core.scheduler.num_waiting == 1
    assert core.pause.settled(core)
    core.resume_generation()
    assert not llm.is_paused()
    done = step_all(llm)
    assert done["late"].token_ids == want["a"][0] and done["late"].finish_reason == "length"


def test_pause_waits_for_in_flight_and_update_while_paused(setup) -> None:
    llm, want, weights_b, weights_a = setup
    core = llm.llm_engine.core
    add(llm, "y0", PROMPTS[0])
    add(llm, "y1", PROMPTS[1])
    llm.llm_engine.step()
    core.pause_generation(wait_for_inflight_requests=True)
    add(llm, "held", PROMPTS[1])
    done = {}
    while not core.pause.settled(core):
        done |= {o.request_id: o.outputs[0] for o in llm.llm_engine.step() if o.finished}
    assert sorted(done) == ["y0", "y1"]
    assert [done["y0"].token_ids, done["y1"].token_ids] == want["a"]
    assert core.scheduler.num_waiting == 1 and not core.has_unfinished_requests()
    llm.update_weights(weights_b)  # the held request does not block the update
    llm.resume_generation()
    done = step_all(llm)
    assert done["held"].token_ids == want["b"][1]
    llm.update_weights(weights_a)


def test_offline_pause_refuses_generate_until_resume(setup) -> None:
    llm, want, _, _ = setup
    llm.pause_generation(wait_for_inflight_requests=True)
    assert llm.is_paused()
    with pytest.raises(ValueError, match="paused"):
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.core.scheduler.requests  # aborted (their ends flush later)
    llm.pause_generation()  # again: nothing changes
    llm.resume_generation()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want["a"]


def test_a_step_is_idle_only_when_it_did_nothing(setup, monkeypatch) -> None:
    """EngineCore.last_step_idle (core_proc then waits for input a moment instead of spinning):
    false for steps that launch, finish or return work, true for a step that schedules nothing
    with nothing in flight while a request is unfinished (as one waiting on a remote KV
    fetch: here the scheduler is made to schedule nothing)."""
    llm, want, _, _ = setup
    core = llm.llm_engine.core
    add(llm, "i0", PROMPTS[0])
    seen = []
    while core.has_unfinished_requests():
        llm.llm_engine.step()
        seen.append(core.last_step_idle)
    assert seen and not any(seen)
    add(llm, "i1", PROMPTS[1])
    monkeypatch.setattr(core.scheduler, "schedule", lambda **kw: SchedulerOutput())
    llm.llm_engine.step()
    assert core.has_unfinished_requests() and core.last_step_idle
    monkeypatch.undo()
    done = step_all(llm)
    assert done["i1"].token_ids == want["a"][1] and core.last_step_idle is False
