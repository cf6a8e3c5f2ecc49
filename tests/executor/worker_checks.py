"""Checks the executor tests share: greedy tokens through `shoal serve`, and a worker killed
mid-generation failing the engine's step in time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from shoal import SamplingParams
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
