"""Engines created and shut down one after another in one process (issue 37): once shut down
(or asleep first, or never shut down) and dropped, no parameter, buffer or KV tensor of the
engine stays alive after a collection; an engine still serving frees a dropped one's weights
at its next step, and a new engine on CUDA before it sizes its KV pool, without the caller
collecting; and two engines never share a rotary table, so one's sleep leaves the other
serving the same tokens. With the start-up heap frozen (engine/startup_heap.py), as outside
the test suite."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.engine.startup_heap import collect_stopped_engines

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
PROMPT = {"prompt_token_ids": list(range(5, 45))}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def frozen_startup_heap(monkeypatch):
    """As engines run outside the test suite (conftest.py turns the freeze off)."""
    monkeypatch.setenv("SHOAL_FREEZE_STARTUP_HEAP", "1")


def tokens(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def engine_tensors(llm: LLM) -> dict[str, weakref.ref]:
    """Weak references to every parameter, buffer and KV cache tensor of the engine."""
    runner = llm.llm_engine.core.runner
    refs = {n: weakref.ref(p) for n, p in runner.model.named_parameters()}
    refs |= {n: weakref.ref(b) for n, b in runner.model.named_buffers()}
    refs |= {f"kv_caches.{i}": weakref.ref(t) for i, t in enumerate(runner.kv_caches)}
    assert len(runner.kv_caches) == 2 and any(n.startswith("model.layers.0.mlp") for n in refs)
    return refs


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [n for n, r in refs.items() if r() is not None]


@pytest.mark.parametrize("end", ["shutdown", "sleep_then_shutdown", "dropped"])
def test_a_dropped_engine_leaves_no_tensor_alive(tiny_llama_dir, end):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    refs = engine_tensors(llm)
    tokens(llm)
    if end == "sleep_then_shutdown":
        llm.sleep(1)  # (the weights in host copies, the KV cache freed)
    if end != "dropped":
        llm.shutdown()
    del llm
    gc.collect()
    assert alive(refs) == []


def test_a_serving_engine_frees_a_dropped_one_and_freezes_again(tiny_llama_dir):
    serving = LLM(model=str(tiny_llama_dir), **ENGINE)
    stopped = LLM(model=str(tiny_llama_dir), **ENGINE)
    refs = engine_tensors(stopped)
    stopped.shutdown()
    del stopped
    assert gc.get_freeze_count() == 0  # thawed: the caller's gc.collect() would free it
    tokens(serving)  # its step collects (freeing the dropped engine's cycles), then freezes
    assert alive(refs) == []
    assert gc.get_freeze_count() > 0
    serving.shutdown()


def test_an_engine_start_on_cuda_frees_the_stopped_ones_first(tiny_llama_dir, monkeypatch):
    """The caller collects nothing: the next engine's start does (on CUDA, where the KV pool
    is sized from the device's free memory), and empties the allocator's cache."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    refs = engine_tensors(llm)
    gc.disable()  # (no collection of the collector's own in between)
    try:
        llm.shutdown()
        del llm
        assert alive(refs)  # reference cycles, left to a collection
        collect_stopped_engines(torch.device("cpu"))  # the CPU's KV budget is fixed
        assert alive(refs) and not emptied
        collect_stopped_engines(torch.device("cuda"))  # as start_engine_core calls it
        assert alive(refs) == [] and emptied == [True]
    finally:
        gc.enable()


def test_one_engines_sleep_leaves_another_serving(tiny_llama_dir):
    a = LLM(model=str(tiny_llama_dir), **ENGINE)
    b = LLM(model=str(tiny_llama_dir), **ENGINE)
    want = tokens(b)
    a.sleep(1)  # frees a's buffers, the rotary table among them, not b's
    assert tokens(b) == want
    a.wake_up()
    assert tokens(a) == want
    a.shutdown()
    b.shutdown()
