"""Which requests of a hidden-state drafter's mirror pass go on to draft (they sample and have
room before max_model_len), known before the mirror runs, so that the rows draft 1 starts
from travel to the device with the pass's other index lists (HiddenStateDrafter in mtp.py),
and how deep they draft: no deeper than the scheduler's draft limits let their next step
verify (ScheduledRequest.draft_limits, engine/draft_budget.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.core.scheduler_output import ScheduledRequest


@dataclass
class MtpRequest:
    """One request of a target step, as the mirror needs it."""

    serial: int
    start: int  # its first token's row in the step's hidden states
    context_len: int
    num_new_tokens: int
    block_ids: list[int]
    state: Any  # the runner's RequestState: prompt + outputs, read once the step is sampled
    sample: bool
    paused: bool = False  # its drafts are not wanted next step: deferred (mirror_backlog.py)
    limit: int | None = None  # drafts its next step verifies at most (None: no limit)


def request_of(it: ScheduledRequest, state: Any, start: int) -> MtpRequest:
    """A step's item as the mirror takes it, once sampled: its draft limit for the rows the
    step leaves (next_step_limit); a limit of 0 pauses it as drafts_paused."""
    limit = sampled_limit(it, state)
    return MtpRequest(it.serial, start, it.context_len, it.num_new_tokens, it.block_ids, state,
                      it.sample, it.drafts_paused or limit == 0, limit)


def sampled_rows(it: Any, state: Any) -> int:
    """The rows a sampled step left of an item (a ScheduledRequest or MtpRequest; state: its
    RequestState with the step's tokens in): its accepted drafts + 1; < 1: nothing new."""
    return min(it.num_new_tokens, state.num_tokens - 1 - it.context_len)


def sampled_limit(it: ScheduledRequest, state: Any) -> int | None:
    """The drafts a step's item may propose once it is sampled: the limit for the outcome it
    had (next_step_limit of sampled_rows); None: no limit."""
    return next_step_limit(it.draft_limits, sampled_rows(it, state))


def drafts_wanted(limit: int | None, paused: bool, rows: int) -> bool:
    """Whether a sampled request is drafted for: not where its limit is 0, nor where its
    drafts are paused and it accepted none (rows <= 1: a paused request mirrored anyway); a
    paused verify step that accepted drafts is (engine/draft_budget.py drafts_paused)."""
    return limit != 0 and not (paused and rows <= 1)


def proposal_depth(it: ScheduledRequest, state: Any, k: int) -> int:
    """How many drafts a sampled step's item may propose (a drafter without rows to keep:
    the draft model): 0 where none are wanted (drafts_wanted), else its limit, at most k."""
    rows = sampled_rows(it, state)
    limit = next_step_limit(it.draft_limits, rows)
    if not drafts_wanted(limit, it.drafts_paused, rows):
        return 0
    return k if limit is None else min(limit, k)


@dataclass
class DraftingRows:
    """The drafting requests' last mirrored row (where draft 1 comes from), sequence length
    and place among the mirrored requests."""

    last: list[int] = field(default_factory=list)
    reqs: list[Any] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    picks: list[int] = field(default_factory=list)
    last_index: torch.Tensor | None = None  # `last` on the device, copied with the mirror's
    limits: list[int | None] = field(default_factory=list)  # each one's (None: no limit)

    def depth(self, k: int) -> int:
        """Drafts to make, at most k: the deepest limit of the drafting requests (a batch
        drafts to one depth; by_serial cuts each request's to its own)."""
        return min(k, max((k if lim is None else lim for lim in self.limits), default=0))

    def by_serial(self, drafts: list[list[int]]) -> dict[int, list[int]]:
        """Each drafting request's drafts (rows in plan order), cut to its own limit: what a
        request proposes follows its own acceptance, never its batch-mates' (the batch ran to
        the deepest limit)."""
        return {r.serial: d if lim is None else d[:lim]
                for r, d, lim in zip(self.reqs, drafts, self.limits)}


def next_step_limit(limits: tuple[int, ...], rows: int) -> int | None:
    """A request's draft limit (ScheduledRequest.draft_limits) once its step mirrors `rows`
    rows (the step's accepted drafts + 1); None: no limit."""
    return limits[min(rows, len(limits)) - 1] if limits and rows > 0 else None


def drafting_rows(kept: Sequence[tuple[Any, int]], max_model_len: int) -> DraftingRows:
    """kept: the mirrored requests (MtpRequest) and their row counts, in row order."""
    plan = DraftingRows()
    row = 0
    for b, (r, n) in enumerate(kept):
        row += n
        seq_len = r.state.num_tokens
        if r.sample and drafts_wanted(r.limit, r.paused, n) and seq_len < max_model_len - 1:
            plan.last.append(row - 1)
            plan.reqs.append(r)
            plan.lens.append(seq_len)
            plan.picks.append(b)
            plan.limits.append(r.limit)
    return plan
