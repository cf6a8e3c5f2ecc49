"""The engine core's side of structured outputs: grammars compile off the step loop (a request
waits in the scheduler until its own is ready; one that fails to compile ends with a bad
request error), and each step's grammar bitmask is filled on the host while the device runs
the step's forward pass, then handed to Executor.sample as plain data.

A row whose input is a token a step in flight samples (async scheduling) cannot be filled
before that step's results have reached its grammar: such a step is sampled once it is the
oldest in flight (engine/step_queue.py)."""

from __future__ import annotations

from typing import Any

from shoal.core.request import Request
from shoal.core.scheduler_output import PENDING_TOKEN, GrammarBitmask, SchedulerOutput
from shoal.structured_output.manager import StructuredOutputManager


class StructuredSteps:
    def __init__(self, manager: StructuredOutputManager):
        self.manager = manager
        self._compiling: dict[int, Request] = {}  # by serial: compiling, not yet seen ready
        self._serials: set[int] = set()  # live structured requests

    def add(self, request: Request) -> None:
        """A request with a grammar (its serial given): schedulable once check() saw it."""
        self._serials.add(request.serial)
        self._compiling[request.serial] = request

    def remove(self, serials: set[int]) -> None:
        self._serials -= serials

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def check(self, fail: Any) -> None:
        """Grammars that finished compiling; fail(request, message) ends a request whose
        grammar failed (the client's fault)."""
        for serial, req in list(self._compiling.items()):
            if req.structured.is_compiled():
                del self._compiling[serial]
                error = req.structured.settle()
                if error is not None:
                    fail(req, error)

    def wait_compiling(self, timeout: float = 0.01) -> None:
        """Nothing to run but grammars: wait a moment for one of them."""
        self.manager.wait_any([r.structured for r in self._compiling.values()], timeout)

    def waits_for_step_ahead(self, sched: SchedulerOutput) -> bool:
        """Whether a structured row of the step takes its input from a step in flight."""
        return bool(self._serials) and any(
            it.sample and it.serial in self._serials and it.input_token_ids[-1] == PENDING_TOKEN
            for it in sched.scheduled)

    def bitmask(self, sched: SchedulerOutput,
                request_by_serial: Any) -> GrammarBitmask | None:
        """The structured rows that sample this step and what each may sample (a verify step:
        a row per position of each request, after each of its drafts)."""
        if not self._serials:
            return None
        serials, grammars = [], []
        drafts: list[list[int]] | None = [] if sched.has_drafts else None
        for item in sched.scheduled:
            if item.sample and item.serial in self._serials:
                req = request_by_serial(item.serial)
                if req is not None and req.structured is not None:
                    serials.append(item.serial)
                    grammars.append(req.structured)
                    if drafts is not None:
                        k = item.num_draft_tokens
                        drafts.append(item.input_token_ids[-k:] if k else [])
        if not grammars:
            return None
        return GrammarBitmask(serials, self.manager.fill_bitmask(grammars, drafts))

    def shutdown(self) -> None:
        self.manager.shutdown()
