"""The scheduler's live requests, by the caller's id and by serial, and what ends outside a step.

A request's serial is the scheduler's own number for it, unique for the engine's lifetime:
results of steps in flight are matched on it, never on the caller's id, which may be reused
meanwhile. Requests that end between steps (an abort, request_timeout, a grammar that fails
to compile) leave an output to send with the next step's, and every ended request's serial
is collected for the runner to drop its state."""

from __future__ import annotations

import itertools
import time

from shoal.core.errors import ErrorCode
from shoal.core.request import Request
from shoal.core.types import EngineCoreOutput


class RequestTable:
    def __init__(self, request_timeout: float | None = None):
        """request_timeout: seconds from arrival after which a request is ended with an
        error (expired())."""
        self.by_id: dict[str, Request] = {}
        self.by_serial: dict[int, Request] = {}
        self._serials = itertools.count(1)
        self.request_timeout = request_timeout
        self._next_expiry_check = 0.0
        self._finished_serials: set[int] = set()  # for the runner to drop state
        self._pending_outputs: list[EngineCoreOutput] = []  # ends not tied to a step

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, req: Request) -> None:
        """Gives the request its serial."""
        if req.request_id in self.by_id:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.serial = next(self._serials)
        self.by_id[req.request_id] = req
        self.by_serial[req.serial] = req
        if self._pending_outputs:  # the end of an earlier request under this id is old news
            self._pending_outputs = [o for o in self._pending_outputs
                                     if o.request_id != req.request_id]

    def remove(self, req: Request) -> None:
        self.by_id.pop(req.request_id, None)
        self.by_serial.pop(req.serial, None)
        self._finished_serials.add(req.serial)

    def is_live(self, req: Request) -> bool:
        return self.by_serial.get(req.serial) is req

    def expired(self) -> list[Request]:
        """Requests older than request_timeout (looked for a few times a second at most)."""
        limit = self.request_timeout
        now = time.monotonic()
        if limit is None or now < self._next_expiry_check:
            return []
        self._next_expiry_check = now + min(0.05, limit / 10)
        return [r for r in self.by_id.values() if now - r.arrival_time > limit]

    def timeout_message(self) -> str:
        assert self.request_timeout is not None
        return timeout_message(self.request_timeout)

    def emit(self, output: EngineCoreOutput) -> None:
        """An output to send with the next step's (a request that ended between steps)."""
        self._pending_outputs.append(output)

    @property
    def has_pending_outputs(self) -> bool:
        return bool(self._pending_outputs)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

    def take_finished_serials(self) -> set[int]:
        """Serials of the requests that ended since the last call."""
        ids, self._finished_serials = self._finished_serials, set()
        return ids


class RequestTableFront:
    """What both schedulers show of their request table: the live requests, the timeout the
    engine may change while it runs, and what ended outside a step."""

    table: RequestTable

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests by the caller's id."""
        return self.table.by_id

    @property
    def request_timeout(self) -> float | None:
        return self.table.request_timeout

    @request_timeout.setter
    def request_timeout(self, seconds: float | None) -> None:
        self.table.request_timeout = seconds

    def request_by_serial(self, serial: int) -> Request | None:
        return self.table.by_serial.get(serial)

    def has_unfinished_requests(self) -> bool:
        return bool(self.table.by_id) or self.table.has_pending_outputs

    def take_finished_serials(self) -> set[int]:
        """Serials of the requests that ended since the last call (the runner drops them)."""
        return self.table.take_finished_serials()

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        return self.table.take_pending_outputs()


def error_output(req: Request, message: str, code: ErrorCode) -> EngineCoreOutput:
    """The output of a request the engine ended with an error."""
    return EngineCoreOutput(req.request_id, [], finish_reason="error",
                            num_cached_tokens=max(req.num_cached_tokens, 0), error=message,
                            error_code=code)


def engine_failed_message(error: str) -> str:
    return f"the engine failed while running this request: {error}"


def timeout_message(limit: float) -> str:
    return f"the request timed out: it took longer than request_timeout ({limit:g} s)"
