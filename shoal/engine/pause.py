"""Generation paused and resumed around a weight update (vLLM's pause_generation /
resume_generation), in the engine core so that the offline LLM and the server behave alike.

Pausing with wait_for_inflight_requests False aborts every live request (each ends with
finish_reason "abort"); with True, the requests live at the pause (running, preempted or
still waiting) run to their end. Either way, a request added while paused waits in the
queue, never admitted, until resume: it holds no KV blocks and no runner state, so an engine
whose only requests are such held ones counts as idle (has_unfinished_requests is False):
update_weights and sleep may run, the serving loop blocks on its socket instead of spinning,
and those requests compute their whole prompt with the new weights after the resume.
clear_cache resets the prefix cache once the engine is idle (at once when it already is,
else at the end of the step that drains it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.core.request import Request


class GenerationPause:
    """The core's pause state; Admission asks `holds` of each waiting request."""

    def __init__(self) -> None:
        self.paused = False
        # The offline LLM: nothing could resume a generate call made while paused, so a
        # step with only held requests raises instead of spinning forever.
        self.offline = False
        self._draining: set[int] = set()  # serials of the requests live at a waiting pause
        self._clear_pending = False

    @classmethod
    def attached(cls, scheduler: Any) -> GenerationPause:
        """A pause whose state the scheduler's admission reads (none for pooling: its
        requests are then held only by the serving loop not stepping an idle engine)."""
        pause = cls()
        if hasattr(scheduler, "admission"):
            scheduler.admission.pause = pause
        return pause

    def pause(self, core: Any, wait: bool, clear_cache: bool) -> None:
        table = core.scheduler.table
        if wait:  # (a second pause adds the requests that arrived meanwhile: they run too)
            self._draining |= {r.serial for r in table.by_id.values()}
        else:
            core.abort_requests(list(table.by_id))
            self._draining.clear()
        self.paused = True
        self._clear_pending = clear_cache
        self.settle(core)

    def resume(self) -> None:
        self.paused = False
        self._draining.clear()
        self._clear_pending = False

    def holds(self, req: Request) -> bool:
        """A request arrived while paused: not admitted until resume."""
        return self.paused and req.serial not in self._draining

    def idle(self, scheduler: Any) -> bool:
        """Paused, with only held requests left and no output to send."""
        if not self.paused or scheduler.table.has_pending_outputs:
            return False
        live = scheduler.table.by_id.values()
        if self._draining and not any(r.serial in self._draining for r in live):
            self._draining.clear()  # drained: (ids may be reused, serials never are)
        return not self._draining

    def settled(self, core: Any) -> bool:
        """Paused, drained, no step in flight, and the prefix cache cleared if asked."""
        return self.idle(core.scheduler) and not core.queue and not self._clear_pending

    def settle(self, core: Any) -> None:
        """After a step (and at the pause): the prefix cache reset once nothing holds
        blocks, when the pause asked for it."""
        if self._clear_pending and not core.queue and self.idle(core.scheduler):
            self._clear_pending = not core.reset_prefix_cache()

    def check_step(self, core: Any) -> None:
        """Offline: a step with nothing but held requests could never end."""
        if self.offline and self.idle(core.scheduler) and not core.queue:
            raise ValueError("generation is paused: resume_generation() before generating")
