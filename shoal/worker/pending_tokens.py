"""Async scheduling: step N+1 is launched before step N's tokens reach the host, so a request's
next input is the token step N samples. The scheduler marks it PENDING_TOKEN; the runner
keeps step N's sampled ids on the device, with each request's row in them, and copies them
into step N+1's input ids there."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.host_to_device import to_device


class PendingTokens:
    def __init__(self) -> None:
        self.sampled: torch.Tensor | None = None  # [rows] int64 on the device
        self.rows: dict[int, int] = {}  # request serial -> its row in `sampled`

    def set(self, sampled: torch.Tensor | None, serials: list[int]) -> None:
        """The ids the latest sampled step drew (None: a step nothing may read them from)."""
        self.sampled = sampled
        self.rows = {} if sampled is None else {s: i for i, s in enumerate(serials)}

    def clear(self) -> None:
        self.sampled, self.rows = None, {}

    def filler(self, dst: list[int], src: list[int]) -> Callable[[torch.Tensor], None] | None:
        """What writes the pending tokens into a step's device input ids (flat index dst[i]
        takes row src[i] of the sampled ids); None when the step has none."""
        if not dst:
            return None
        prev = self.sampled
        assert prev is not None, "a pending token, but no sampled step to take it from"

        def fill(ids: torch.Tensor) -> None:
            k = len(dst)
            if dst == src and dst[-1] == k - 1:  # same rows, same order: the steady batch
                ids[:k].copy_(prev[:k])
            else:
                ids[to_device(dst, torch.long, ids.device)] = prev[
                    to_device(src, torch.long, ids.device)]
        return fill
