"""The scheduler's queue of requests waiting to run."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from shoal.core.request import Request


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, req: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))
        else:
            self._fifo.append(req)

    def push_front(self, req: Request) -> None:
        if self.policy == "priority":
            self.push(req)
        else:
            self._fifo.appendleft(req)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, req: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(req)

    def __contains__(self, req: Request) -> bool:
        if self.policy == "priority":
            return any(e[3] is req for e in self._heap)
        return any(r is req for r in self._fifo)

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests (in queue order for fcfs; any order for priority)."""
        if self.policy == "priority":
            return iter([e[3] for e in self._heap])
        return iter(self._fifo)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)
