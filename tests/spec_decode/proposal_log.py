"""Records every proposal a hidden-state drafter (mtp, eagle) makes in an LLM's engine."""

from __future__ import annotations


def record_proposals(llm) -> list[tuple[list[int], list[int]]]:
    """Every proposal the engine makes from now on: (the sequence then, its drafts)."""
    drafter = llm.llm_engine.core.runner.drafter  # a hidden-state drafter
    log: list[tuple[list[int], list[int]]] = []
    inner = drafter.mirror_and_propose

    def recording(reqs, hidden, failed, propose=True):
        drafts = inner(reqs, hidden, failed, propose=propose)
        for r in reqs:
            if r.serial in drafts:
                log.append((r.state.prompt_token_ids + r.state.output_token_ids,
                            drafts[r.serial]))
        return drafts
    drafter.mirror_and_propose = recording
    return log


class StepLog:
    """For each step an LLM's engine launches: whether another step was in flight then
    (async scheduling pipelined it) and whether it verifies drafts."""

    def __init__(self, llm):
        core = llm.llm_engine.core
        self.steps: list[tuple[bool, bool]] = []
        inner = core.runner.execute

        def execute(sched):
            if not sched.is_empty:  # (the step itself is in the queue already)
                self.steps.append((len(core.queue) > 1, sched.has_drafts))
            return inner(sched)
        core.runner.execute = execute

    @property
    def pipelined(self) -> int:
        return sum(p for p, _ in self.steps)

    @property
    def verifies(self) -> int:
        return sum(d for _, d in self.steps)

    def verify_pipelined(self) -> bool:
        """A verify step launched while another step ran (never allowed)."""
        return any(p and d for p, d in self.steps)
