"""Which requests of a hidden-state drafter's mirror pass go on to draft (they sample and have
room before max_model_len), known before the mirror runs, so that the rows draft 1 starts
from travel to the device with the pass's other index lists (HiddenStateDrafter in mtp.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DraftingRows:
    """The drafting requests' last mirrored row (where draft 1 comes from), sequence length
    and place among the mirrored requests."""

    last: list[int] = field(default_factory=list)
    reqs: list[Any] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    picks: list[int] = field(default_factory=list)
    last_index: torch.Tensor | None = None  # `last` on the device, copied with the mirror's


def drafting_rows(kept: Sequence[tuple[Any, int]], max_model_len: int) -> DraftingRows:
    """kept: the mirrored requests (MtpRequest) and their row counts, in row order."""
    plan = DraftingRows()
    row = 0
    for b, (r, n) in enumerate(kept):
        row += n
        seq_len = r.state.num_tokens
        if r.sample and seq_len < max_model_len - 1:
            plan.last.append(row - 1)
            plan.reqs.append(r)
            plan.lens.append(seq_len)
            plan.picks.append(b)
    return plan
