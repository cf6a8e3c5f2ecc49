"""What a hidden-state head has not mirrored of a request while its drafts are paused.

A request whose drafts keep failing backs off (engine/draft_budget.py): for up to 64 decode
steps the scheduler verifies none of its drafts, and says so per step
(ScheduledRequest.drafts_paused). Mirroring those steps into the head's KV cache meanwhile
costs a head forward pass a step (an 8B-shaped EAGLE-3 layer reads ~0.6 GB: ~0.2 ms on an
H100, 3-4% of a batch-1 decode step) for drafts nobody verifies. So the drafter keeps each
paused row's input state instead (one row of the target's final hidden states; EAGLE-3: of
its aux states, before the fc) and mirrors the rows kept, ahead of the step's own, in the
first step that mirrors the request again: one prefill-shaped pass. The head is causal, so
its KV comes out as the step-by-step mirror's (within a kernel's rounding).

Only single decode rows are kept, at most MAX_ROWS a request (a paused request with that
many is mirrored, backlog first): their memory is outside the KV budget (an 8B EAGLE-3
head's raw aux row is 24 KiB: 384 KiB a request), and a catch-up every MAX_ROWS paused steps
costs ~1/MAX_ROWS of the mirrors it saves. The backlog lives on the runner's RequestState:
it goes when the request does. A request that ends while paused never writes those
positions' head KV; a later prompt sharing those blocks through the prefix cache drafts from
stale head KV there (worse drafts, never a wrong output: the target verifies every draft)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.host_to_device import to_device

MAX_ROWS = 16


@dataclass
class RawRows:
    """A step's input states not yet turned into the head's (EAGLE-3: aux states before the
    fc), so that the rows kept for later skip that work too."""

    rows: torch.Tensor


@dataclass
class MirrorBacklog:
    """Positions [start, end) of one request, not mirrored yet, with their input states in
    order (`rows`: tensors of [n, width], the views of the steps' kept rows)."""

    start: int
    rows: list[torch.Tensor] = field(default_factory=list)
    end: int = 0

    def __post_init__(self) -> None:
        self.end = self.start + sum(r.shape[0] for r in self.rows)


def can_defer(state: object, context_len: int, rows: int) -> bool:
    """Whether `rows` more rows of a request at context_len fit its backlog."""
    backlog: MirrorBacklog | None = getattr(state, "drafter_backlog", None)
    held = backlog.end - backlog.start if backlog is not None and backlog.end == context_len \
        else 0
    return rows == 1 and held + rows <= MAX_ROWS


def defer(state: object, context_len: int, rows: torch.Tensor) -> None:
    """Keeps `rows`, a request's input states at positions context_len onwards, on its
    RequestState. A backlog that does not end at context_len (a rolled-back or recomputed
    request) is dropped: what it held is mirrored again from the request's own tokens."""
    backlog: MirrorBacklog | None = getattr(state, "drafter_backlog", None)
    if backlog is None or backlog.end != context_len:
        backlog = MirrorBacklog(context_len)
    backlog.rows.append(rows)
    backlog.end += rows.shape[0]
    state.drafter_backlog = backlog  # type: ignore[attr-defined]


def take(state: object, context_len: int) -> MirrorBacklog | None:
    """The request's backlog, if it ends where this step's rows begin (else None: stale),
    and clears it."""
    backlog: MirrorBacklog | None = getattr(state, "drafter_backlog", None)
    if backlog is None:
        return None
    state.drafter_backlog = None  # type: ignore[attr-defined]
    return backlog if backlog.end == context_len and backlog.rows else None


def defer_rows(deferred: list[tuple[object, int, int, int]], hidden: torch.Tensor | RawRows,
               device: torch.device) -> None:
    """Keeps each (request state, context length, first row in the step, rows) of `hidden`
    on its request, in one gather: the step's states are a buffer the next step may
    overwrite."""
    states = hidden.rows if isinstance(hidden, RawRows) else hidden
    idx = [i for _, _, start, n in deferred for i in range(start, start + n)]
    rows = states[to_device(idx, torch.long, device)]
    at = 0
    for state, context_len, _, n in deferred:
        defer(state, context_len, rows[at:at + n])
        at += n


def mirror_states(hidden: torch.Tensor | RawRows, rows: list[int],
                  spans: list[tuple[int, int]], backlogs: list[MirrorBacklog | None],
                  input_states: Callable[[torch.Tensor], torch.Tensor],
                  device: torch.device, row_index: torch.Tensor | None = None) -> torch.Tensor:
    """The head's input states of a mirror: per request (spans: its first row in the step
    and rows mirrored; `rows`: all of them, flat) its backlog's rows, then its own.
    input_states turns raw rows into the head's (EAGLE-3's fc). row_index: `rows` on the
    device already (copied with the mirror's other inputs)."""
    raw = isinstance(hidden, RawRows)
    states = hidden.rows if isinstance(hidden, RawRows) else hidden
    if all(b is None for b in backlogs):
        if len(rows) == states.shape[0]:
            h = states
        else:
            h = states[to_device(rows, torch.long, device) if row_index is None else row_index]
        return input_states(h) if raw else h
    # Kept rows are raw (EAGLE-3 keeps a step's aux states raw whenever a request in it is
    # paused): in a step that is not, they go through input_states on their own.
    back = [t for b in backlogs if b is not None for t in b.rows]
    done = None if raw else input_states(torch.cat(back))
    pieces: list[torch.Tensor] = []
    at = 0
    for (start, n), b in zip(spans, backlogs):
        if b is not None:
            if done is None:
                pieces.extend(b.rows)
            else:
                pieces.append(done[at:at + b.end - b.start])
            at += b.end - b.start
        pieces.append(states[start:start + n])
    h = torch.cat(pieces)
    return input_states(h) if raw else h
