"""Checks the executor tests share: greedy tokens through `shoal serve`, a worker killed
mid-generation failing the engine's step in time, tokens and logprobs compared with one
rank's, and a log of the pipeline micro-batches in flight."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from shoal import LLM, SamplingParams
from shoal.core.scheduler_output import SchedulerOutput
from shoal.executor.multiproc import WorkerDiedError


def served_tokens(model: str, flags: list[str], prompt: list[int]) -> list[int]:
    """The token ids of an 8-token greedy completion (ignore_eos) of `prompt` from
    `shoal serve model <flags>` on the CPU, asked with the openai client."""
    from entrypoints.conftest import RemoteServer

    server = RemoteServer(model, *flags, "--device", "cpu", "--dtype", "float32",
                          "--max-num-seqs", "4", "--max-model-len", "128")
    try:
        out = server.openai().completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        return list(out.choices[0].token_ids)
    finally:
        server.stop()


def assert_kill_fails_step(engine: Any, kill: Callable[[], None], prompts: list[list[int]],
                           max_tokens: int, seconds: float = 10) -> None:
    """Starts long greedy requests, runs three steps, kills a worker with kill(): the steps
    after it raise WorkerDiedError naming rank 1 within `seconds`."""
    long = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, long)
    for _ in range(3):
        engine.step()
    kill()
    killed = time.monotonic()
    with pytest.raises(WorkerDiedError, match="shoal-tp-rank1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - killed < seconds


def generate_outputs(llm: LLM, prompts: list, params: SamplingParams) -> list:
    """(token ids, logprobs, prompt logprobs) of each prompt's first completion."""
    outs = llm.generate(prompts, params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs, o.prompt_logprobs)
            for o in outs]


def assert_close(one: list, other: list, tol: float) -> None:
    """generate_outputs of two engines: the same tokens, logprobs within tol."""
    for (ids1, lp1, plp1), (ids2, lp2, plp2) in zip(one, other, strict=True):
        assert ids2 == ids1
        for a, b in zip((lp1 or []) + (plp1 or []), (lp2 or []) + (plp2 or []), strict=True):
            if a is None:
                assert b is None
                continue
            assert a.keys() == b.keys()
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < tol


class StepLog:
    """Records the engine's launches and finishes on its executor, with each step's sampling
    serials: how many steps were in flight at once, and whether they shared a request."""

    def __init__(self, runner: Any) -> None:
        self.events: list[str] = []
        self.in_flight: list[set[int]] = []
        self.most = 0
        execute, finish = runner.execute, runner.finish

        def logged_execute(sched: SchedulerOutput) -> Any:
            serials = {it.serial for it in sched.scheduled if it.sample}
            assert not any(serials & s for s in self.in_flight), "a request in two steps"
            self.in_flight.append(serials)
            self.most = max(self.most, len(self.in_flight))
            self.events.append("L")
            return execute(sched)

        def logged_finish(handle: Any) -> Any:
            self.in_flight.pop(0)
            self.events.append("F")
            return finish(handle)

        runner.execute, runner.finish = logged_execute, logged_finish
