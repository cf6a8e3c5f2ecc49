"""An opt-in trace of the engine core loop, for finding where serving time goes.

`SHOAL_STEP_TRACE=/path/trace.jsonl` makes the engine core process append one JSON line per
loop iteration that did something: when it started (monotonic seconds), how long input
draining, the step and the output send took, requests added, tokens scheduled and requests
running. Off by default (no cost but one attribute check per iteration); lines are buffered
and written in chunks so the trace does not itself slow the loop."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import IO

from shoal import envs


@dataclass
class StepRecord:
    t: float  # loop iteration start, time.monotonic()
    drain_ms: float  # reading and adding requests from the input socket
    step_ms: float  # core.step(): schedule, launch, read the previous step's tokens
    send_ms: float  # encoding and sending the outputs
    added: int  # requests added in this iteration
    tokens: int  # tokens in the step scheduled this iteration
    running: int  # requests running after the step
    waiting: int  # requests waiting after the step


class StepTrace:
    FLUSH_EVERY = 512

    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", encoding="utf-8")
        self._buffer: list[str] = []

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = envs.SHOAL_STEP_TRACE.get()
        return cls(path) if path else None

    def record(self, rec: StepRecord) -> None:
        self._buffer.append(json.dumps(asdict(rec)))
        if len(self._buffer) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._file.write("\n".join(self._buffer) + "\n")
            self._file.flush()
            self._buffer.clear()

    def close(self) -> None:
        self.flush()
        self._file.close()


def now() -> float:
    return time.monotonic()
