"""Per-step int64 inputs of a captured CUDA graph (token ids, positions, ...), copied from
pinned host memory into a persistent device buffer without making the host wait.

A graph of `size` tokens reads rows [rows, size] laid out contiguously at the start of one
flat device buffer; each size has its own view, fixed when that graph is captured. So a step
is one copy of a contiguous host range: a strided source would be copied through a pageable
temporary, and CUDA may hold the host until such a copy has been staged.

Two host buffers are used in turn: with async scheduling, step N+1 is staged while step N's
copy may still be queued, but step N-1's has completed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _pinned_numpy(numel: int, device: torch.device) -> Any:
    """A zeroed int64 numpy array in page-locked memory when copies go to a CUDA device."""
    return torch.zeros(numel, dtype=torch.long, pin_memory=device.type == "cuda").numpy()


class StagedTokens:
    def __init__(self, rows: int, max_size: int, device: torch.device):
        self.rows, self.max_size = rows, max_size
        self.buffer = torch.zeros(rows * max_size, dtype=torch.long, device=device)
        self._host = [_pinned_numpy(rows * max_size, device) for _ in range(2)]
        self._turn = 0

    def view(self, size: int) -> torch.Tensor:
        """[rows, size]: the device inputs of a graph of `size` tokens."""
        if not 0 < size <= self.max_size:
            raise ValueError(f"size {size} outside (0, {self.max_size}]")
        return self.buffer[: self.rows * size].view(self.rows, size)

    def stage(self, size: int, values: Sequence[Sequence[int]]) -> torch.Tensor:
        """Copies values[r] into row r of view(size), zero past each row's values; returns the
        view. The copy is queued on the current stream (asynchronous on CUDA)."""
        if len(values) != self.rows or any(len(v) > size for v in values):
            raise ValueError(f"need {self.rows} rows of at most {size} values")
        dst = self.view(size)
        host = self._host[self._turn][: self.rows * size].reshape(self.rows, size)
        self._turn ^= 1
        for r, vals in enumerate(values):
            host[r, : len(vals)] = vals
            host[r, len(vals):] = 0
        dst.copy_(torch.from_numpy(host), non_blocking=True)
        return dst
