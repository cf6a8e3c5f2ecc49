"""How the --api-server-count supervisor (api_server_pool.py) bounds its restarts of API
processes that die, and how it words their exits."""

from __future__ import annotations

import signal
from collections import deque

RESTART_LIMIT = 5  # restarts of one index ...
RESTART_WINDOW_S = 60.0  # ... within this long; one more death and it stays dead
FIRST_BACKOFF_S = 0.5  # the wait before a second restart within the window, doubled after
MAX_BACKOFF_S = 8.0


class RestartBudget:
    """How often each API process index may be restarted: at most `limit` restarts within
    any `window_s` seconds. An index that keeps dying (a fault at start-up, a request that
    crashes it each time it is retried) is then left dead instead of restarted in a loop."""

    def __init__(self, limit: int = RESTART_LIMIT, window_s: float = RESTART_WINDOW_S):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.limit = limit
        self.window_s = window_s
        self._times: dict[int, deque[float]] = {}

    def take(self, index: int, now: float) -> bool:
        """True (and counted) if `index` may be restarted at time `now` (monotonic seconds);
        False once it has had `limit` restarts within the last `window_s`."""
        times = self._times.setdefault(index, deque())
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if len(times) >= self.limit:
            return False
        times.append(now)
        return True

    def backoff_s(self, index: int) -> float:
        """How long to wait before the restart just taken: none for the first within the
        window (a one-off crash comes back at once), then FIRST_BACKOFF_S doubling up to
        MAX_BACKOFF_S, so a process that dies at start-up does not spin the CPU."""
        n = self.recent(index)
        return 0.0 if n <= 1 else min(FIRST_BACKOFF_S * 2 ** (n - 2), MAX_BACKOFF_S)

    def recent(self, index: int) -> int:
        """The restarts of `index` counted in its window (as of the last take)."""
        return len(self._times.get(index, ()))


def describe_exit(exitcode: int | None) -> str:
    """multiprocessing's exitcode in words: a negative one is the signal that killed it."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
