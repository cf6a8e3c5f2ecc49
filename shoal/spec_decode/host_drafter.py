"""Drafters that propose on the host from a request's tokens alone (no layers, no KV cache):
each request that sampled gets its drafts as soon as the step's tokens are read."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.distributed.parallel_state import get_tp_rank
from shoal.worker.drafter import Drafter, TargetStep


class HostDrafter(Drafter):
    @abstractmethod
    def draft(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        """Up to k drafts continuing prompt + output (none: nothing to verify)."""

    def propose(self, step: TargetStep, state: Any, out: ModelRunnerOutput,
                latest: bool) -> None:
        # Drafted even behind a later step: cheap, and the scheduler reads whether any came.
        # Under tensor parallelism only rank 0's drafts reach the scheduler, and drafting
        # here runs no collective: the other ranks skip it.
        if get_tp_rank() != 0:
            return
        inp = step.inputs
        for serial, st in zip(inp.sample_rows, inp.sample_states):
            if serial in out.sampled_token_ids:
                drafts = self.draft(st.prompt_token_ids, st.output_token_ids)
                if drafts:
                    out.draft_token_ids[serial] = drafts
