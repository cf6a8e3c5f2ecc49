"""Model-free engine cores for tests that run the real engine-core process loop
(shoal.engine.core_proc.run_engine_core): picklable builders for its `build_core`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from shoal.core.types import EngineCoreOutputs, EngineCoreRequest
from shoal.engine.request_checks import EngineLimits


class SignalledCore:
    """Sends itself SIGTERM in the middle of its first step and writes down what ran."""

    limits = EngineLimits(vocab_size=100, max_model_len=64, num_kv_blocks=16, block_size=16,
                          max_num_seqs=4)

    def __init__(self, log: str, signal_in_step: bool):
        self.log = Path(log)
        self.signal_in_step = signal_in_step
        self.busy = False
        self._event("ready")

    def _event(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(what + "\n")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.busy = True

    def abort_requests(self, ids: list[str]) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return self.busy

    def step(self) -> EngineCoreOutputs:
        self._event("step-start")
        if self.signal_in_step:
            os.kill(os.getpid(), signal.SIGTERM)
        total = sum(range(200_000))  # bytecode boundaries: a Python handler runs in here
        self._event(f"step-end {total > 0}")
        return EngineCoreOutputs()

    def shutdown(self) -> None:
        self._event("shutdown")


def build_signalled_core(log: str, signal_in_step: bool, _engine_args) -> SignalledCore:
    import shoal.engine.core_proc as core_proc

    # An idle loop wakes this rarely on its own: only the signal's self-pipe can end it soon.
    core_proc.IDLE_POLL_MS = 120_000
    return SignalledCore(log, signal_in_step)
