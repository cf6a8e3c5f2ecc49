"""What a hidden-state head has not mirrored of a request while its drafts are paused.

A request whose drafts keep failing backs off (engine/draft_budget.py): for up to 64 decode
steps the scheduler verifies none of its drafts, and says so per step
(ScheduledRequest.drafts_paused; also on a verify step whose full miss backs the request
off; with async scheduling not on the step before the last paused one, whose finish
catches up beside the next forward pass: engine/draft_budget.py drafts_paused).
Mirroring those steps into the head's KV cache meanwhile costs a head forward pass a step
(an 8B-shaped EAGLE-3 layer reads ~0.6 GB: ~0.2 ms on an H100, 3-4% of a batch-1 decode
step) for drafts nobody verifies. So the drafter keeps each
paused row's input state instead (one row of the target's final hidden states; EAGLE-3: of
its aux states, before the fc) and mirrors the rows kept, ahead of the step's own, in the
first step that mirrors the request again: one prefill-shaped pass. The head is causal, so
its KV comes out as the step-by-step mirror's (within a kernel's rounding).

Only single decode rows are kept, at most MAX_ROWS a request (a paused request with that
many is mirrored, backlog first), in the drafter's ring of kept rows (kept_rows.py: MAX_ROWS
+ 3 batches of max_num_seqs rows, allocated with the drafter, so the KV pool is sized after
it; an 8B EAGLE-3 head's raw aux row is 24 KiB: 14 MiB for 32 requests). A catch-up every
MAX_ROWS paused steps costs ~1/MAX_ROWS of the mirrors it saves. Keeping costs the host no
torch call in a step whose requests are all paused (the drafter kept the whole step in the
ring at launch) and a few, whatever the batch, in one that mixes paused and drafting
requests; a catch-up gathers its rows with the pass's other inputs (MirrorSources). The
backlog (ring positions) lives on the runner's RequestState: it goes when the request does.
A request that ends while paused never writes those positions' head KV; a later prompt
sharing those blocks through the prefix cache drafts from stale head KV there (worse drafts,
never a wrong output: the target verifies every draft)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from shoal.spec_decode.drafting_rows import sampled_rows
from shoal.spec_decode.kept_rows import KeptRows, KeptStep

MAX_ROWS = 16


@dataclass
class RawRows:
    """A step's input states not yet turned into the head's (EAGLE-3: aux states before the
    fc), so that the rows kept for later skip that work too."""

    rows: torch.Tensor


@dataclass
class MirrorBacklog:
    """Positions [start, end) of one request, not mirrored yet: their input states are the
    ring's rows at absolute positions `kept`, in order."""

    start: int
    kept: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.kept)


def can_defer(state: object, context_len: int, rows: int) -> bool:
    """Whether `rows` more rows of a request at context_len fit its backlog."""
    backlog: MirrorBacklog | None = getattr(state, "drafter_backlog", None)
    held = backlog.end - backlog.start if backlog is not None and backlog.end == context_len \
        else 0
    return rows == 1 and held + rows <= MAX_ROWS


def defer(state: object, context_len: int, at: int) -> None:
    """Keeps the ring's row at absolute position `at` as a request's input state at position
    context_len. A backlog that does not end at context_len (a rolled-back or recomputed
    request) is dropped: what it held is mirrored again from the request's own tokens."""
    backlog: MirrorBacklog | None = getattr(state, "drafter_backlog", None)
    if backlog is None or backlog.end != context_len:
        backlog = MirrorBacklog(context_len)
        state.drafter_backlog = backlog  # type: ignore[attr-defined]
    backlog.kept.append(at)


def check_kept_step(ring: KeptRows | None, kept_step: KeptStep) -> None:
    """Raises where the ring of kept rows no longer holds a step kept whole at launch."""
    if ring is None or not ring.holds(kept_step.at):
        raise RuntimeError("the ring of kept rows overwrote a step before its mirror "
                           f"(capacity {ring.capacity if ring else 0} rows)")


def defer_kept_step(items: Sequence[Any], states: Sequence[object], ring: KeptRows | None,
                    kept_step: KeptStep, failed: set[int]) -> bool:
    """A step kept whole at launch (its requests all paused) whose every request only adds
    its one row to a backlog with room: each row deferred where the step put it in the ring,
    no per-request object built and no torch call (the host's work of each paused step at
    batch 32 was ~0.4 ms: mirror_and_propose's). False, and nothing deferred, otherwise.
    items: the step's ScheduledRequests; states: their RequestStates, sampled."""
    check_kept_step(ring, kept_step)
    rows: list[tuple[object, int, int]] = []
    start = 0
    for it, st in zip(items, states):
        n = sampled_rows(it, st)
        if it.serial not in failed and n > 0:
            if n != 1 or not can_defer(st, it.context_len, 1):
                return False
            rows.append((st, it.context_len, kept_step.at + start))
        start += it.num_new_tokens
    for st, context_len, at in rows:
        defer(st, context_len, at)
    return True


def take(state: object, context_len: int) -> MirrorBacklog | None:
    """The request's backlog, if it ends where this step's rows begin (else None: stale),
    and clears it."""
    backlog: MirrorBacklog | None = getattr(state, "drafter_backlog", None)
    if backlog is None:
        return None
    state.drafter_backlog = None  # type: ignore[attr-defined]
    return backlog if backlog.end == context_len and backlog.kept else None


@dataclass
class MirrorSources:
    """Where a mirror pass's input rows come from, in the pass's order (per request: its
    backlog's, then its own), as index lists that go to the device with the pass's other
    inputs in one copy."""

    step: list[int]  # rows of the step's states (empty: all of them, in order)
    ring: list[int]  # slots of the ring of kept rows
    order: list[int]  # pass row i is cat([step's rows, ring's rows])[order[i]] (empty: as is)
    from_ring: bool = False  # every row from the ring (a kept step): `ring` alone, in order


def mirror_sources(spans: Sequence[tuple[int, int]],
                   backlogs: Sequence[MirrorBacklog | None], ring: KeptRows | None,
                   kept_step: KeptStep | None, step_rows: int) -> MirrorSources:
    """spans: each mirrored request's first row in the step and how many of its own rows it
    mirrors; backlogs: each one's (or None); kept_step: the step, when it was kept in the
    ring whole at launch; step_rows: the rows of the step's states otherwise."""
    if kept_step is not None:
        assert ring is not None
        slots: list[int] = []
        for (start, n), b in zip(spans, backlogs):
            if b is not None:
                slots.extend(ring.slot(a) for a in b.kept)
            slots.extend(ring.slot(kept_step.at + i) for i in range(start, start + n))
        return MirrorSources([], slots, [], from_ring=True)
    own = [i for start, n in spans for i in range(start, start + n)]
    step = [] if len(own) == step_rows else own
    if all(b is None for b in backlogs):
        return MirrorSources(step, [], [])
    assert ring is not None
    slots, order = [], []
    at_own, at_ring = 0, len(own)
    for (_, n), b in zip(spans, backlogs):
        if b is not None:
            slots.extend(ring.slot(a) for a in b.kept)
            order.extend(range(at_ring, at_ring + len(b.kept)))
            at_ring += len(b.kept)
        order.extend(range(at_own, at_own + n))
        at_own += n
    return MirrorSources(step, slots, order)


def ring_rows(spans: Sequence[tuple[int, int]], backlogs: Sequence[MirrorBacklog | None],
              ring: KeptRows, kept_step: KeptStep | None, states: torch.Tensor | None,
              to_device: Callable[[list[int]], torch.Tensor]) -> list[int] | None:
    """Every row of a mirror pass with backlogs as a slot of the ring, in the pass's order
    (per request: its backlog's, then its own), so that a mirror graph gathers them from
    one tensor (mirror_graphs.py). The step's own rows (states: raw, as the ring's) are
    kept in the ring first, in one copy, unless the step was kept whole at launch. None
    where that copy would overwrite a backlog row the pass reads, or is more than a batch of
    rows (the ring holds MAX_ROWS + 3 batches: more would push other requests' backlogs
    out); the pass runs eagerly then."""
    if kept_step is None:
        assert states is not None
        own = [i for start, n in spans for i in range(start, start + n)]
        oldest = min((min(b.kept) for b in backlogs if b is not None), default=None)
        # (a step keeps a batch at most: the ring's sizing rule, kept_rows.py)
        if len(own) > ring.step_rows or (
                oldest is not None and not ring.holds_after(len(own), oldest)):
            return None
        whole = own == list(range(states.shape[0]))
        at = ring.keep(states if whole else states[to_device(own)])
        starts, base = list(accumulate((n for _, n in spans), initial=0)), at
    else:
        starts, base = [start for start, _ in spans], kept_step.at
    slots: list[int] = []
    for (_, n), b, s0 in zip(spans, backlogs, starts):
        if b is not None:
            slots.extend(ring.slot(a) for a in b.kept)
        slots.extend(ring.slot(base + s0 + i) for i in range(n))
    return slots


def mirror_states(states: torch.Tensor | None, raw: bool, src: MirrorSources,
                  ring: KeptRows | None, index: Sequence[torch.Tensor],
                  input_states: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The head's input states of a mirror pass: src's rows of the step's states (raw: not
    the head's yet) and of the ring (always raw), through input_states (EAGLE-3's fc) where
    raw. index: src.step, src.ring and src.order on the device. A few torch calls, whatever
    the batch."""
    step_t, ring_t, order_t = index
    if src.from_ring:
        assert ring is not None
        return input_states(ring.buf[ring_t])
    assert states is not None
    own = states[step_t] if src.step else states
    if not src.ring:
        return input_states(own) if raw else own
    assert ring is not None
    back = ring.buf[ring_t]
    if raw:
        return input_states(torch.cat([own, back])[order_t])
    return torch.cat([own, input_states(back)])[order_t]
