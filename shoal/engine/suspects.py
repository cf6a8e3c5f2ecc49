"""Requests of steps that raised (the scheduler's; see Scheduler.fail_steps).

A step that raises (a bug or a bad combination of inputs in the runner) must not take the
engine down or fail requests that had nothing to do with it. The requests of that step are
put back to wait, marked as suspects, and rerun one at a time ("isolated"): a suspect runs
alone until it has produced a token again. One that raises while alone fails with the error;
one seen in two failing steps stays isolated until it ends, so a request that fails only in
batches cannot loop forever."""

from __future__ import annotations

from shoal.core.request import Request, RequestStatus
from shoal.engine.failed_blocks import FailedBlocks
from shoal.engine.waiting_queue import WaitingQueue

# A request in this many failing steps stays isolated until it ends.
ISOLATE_FOR_GOOD_AFTER = 2


class Suspects:
    def __init__(self, running: list[Request], waiting: WaitingQueue,
                 failed_blocks: FailedBlocks):
        self.running, self.waiting, self.failed_blocks = running, waiting, failed_blocks
        self.isolated: Request | None = None  # the suspect running alone
        self.num_failed_steps = 0

    def requeue(self, req: Request) -> None:
        """Back to the front of the queue, its runner state to be sent again (what the failed
        steps wrote is unknown: its blocks are withdrawn); it runs alone."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.waiting.push_front(req)
        self.failed_blocks.release(req, failed=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.suspect = True
        self.left(req)

    def next_alone(self) -> Request | None:
        """The suspect at the head of the queue, when one is and it can run now."""
        if not len(self.waiting):
            return None
        head = self.waiting.peek()
        return head if head.suspect and not head.num_pending_tokens else None

    def sampled_fine(self, req: Request) -> None:
        """A request produced a token: a suspect is cleared (unless isolated for good)."""
        if req.suspect and req.num_faults < ISOLATE_FOR_GOOD_AFTER:
            req.suspect = False
            self.left(req)

    def left(self, req: Request) -> None:
        """The request stopped running alone (ended, preempted, cleared or requeued)."""
        if req is self.isolated:
            self.isolated = None
