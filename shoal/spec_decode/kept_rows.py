"""A ring of input-state rows on the device that a hidden-state drafter keeps for later: the
rows of the requests whose drafts are paused (mirror_backlog.py).

A step's rows sit in a buffer the next step overwrites, so a row kept for later is copied.
Copying it into a ring allocated once (rather than into a tensor of its own) makes keeping
one torch call a step, whatever the batch: a step whose requests are all paused is copied
whole at launch, in place of the copy the drafter made of it anyway, and its rows are then
named by position, with no torch call at all in the step's mirror (mtp.py).

Positions are absolute (rows written since the start); row p lives in slot p % capacity until
`capacity` more rows have been written. A run of rows never wraps: a run that would is
written from slot 0 and the ring's tail is skipped. A step keeps a batch at most (at launch,
or in its mirror when it mixes paused and drafting requests), and the drafter's ring holds
MAX_ROWS + 3 batches: a request's oldest kept row outlives its catch-up MAX_ROWS steps later,
the step launched meanwhile (async scheduling) and a skipped tail included. A request the
scheduler leaves out of steps may still lose its rows: its backlog is then dropped (worse
drafts for a while, never a wrong output: the target verifies every draft)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KeptStep:
    """A target step whose every row was kept at launch (its requests are all paused):
    row i of the step is the ring's absolute position at + i."""

    at: int
    num_rows: int


class KeptRows:
    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device,
                 step_rows: int):
        """step_rows: the most rows one step keeps at launch (a batch of decodes)."""
        if not 0 < step_rows <= capacity:
            raise ValueError(f"step_rows must be in [1, capacity={capacity}], got {step_rows}")
        self.capacity = capacity
        self.step_rows = step_rows
        self.buf = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.written = 0  # the absolute position of the next row

    def reserve(self, n: int) -> int:
        """The absolute position of n new contiguous rows (never across the ring's end)."""
        if not 0 < n <= self.capacity:
            raise ValueError(f"rows to keep must be in [1, {self.capacity}], got {n}")
        at = self.written
        if at % self.capacity + n > self.capacity:
            at += self.capacity - at % self.capacity
        self.written = at + n
        return at

    def keep(self, rows: torch.Tensor) -> int:
        """Copies rows [n, width] into the ring (one torch call); their absolute position."""
        if rows.dtype != self.buf.dtype or rows.shape[1:] != self.buf.shape[1:]:
            raise ValueError(f"rows of {rows.dtype} {list(rows.shape[1:])} do not fit a ring "
                             f"of {self.buf.dtype} {list(self.buf.shape[1:])}")
        at = self.reserve(rows.shape[0])
        slot = at % self.capacity
        self.buf[slot:slot + rows.shape[0]] = rows
        return at

    def holds_after(self, n: int, at: int) -> bool:
        """Whether the row at absolute position `at` is still held once n more rows are
        kept (reserve's rule: a run never wraps)."""
        w = self.written
        if w % self.capacity + n > self.capacity:
            w += self.capacity - w % self.capacity
        return at >= w + n - self.capacity

    def holds(self, at: int) -> bool:
        """Whether the row at absolute position `at` has not been overwritten yet."""
        return at >= self.written - self.capacity

    def slot(self, at: int) -> int:
        return at % self.capacity
