"""Per-device int32 counters for kernels whose last program to finish does the closing work:
int4_wide_gemv.py's and int4_mma_gemv.py's K splits (a counter a strip: the last program adds
the partials) and linear_decode_fused.py's column split (a counter a row and head: the last
program norms the whole output). Zero between launches: each last program resets its own.
One launch at a time per device uses them, as shoal runs a model's layers in one stream, so
the kernels share one buffer. A grown buffer keeps the old one alive: CUDA graphs captured
before hold it. It is made or grown outside CUDA-graph capture only (an allocation there
would live in the graph's pool, zeroed by nothing)."""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 4096


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def counters_ready(device: torch.device, count: int) -> bool:
    """Whether `count` counters exist on `device` or can be made now."""
    have = _COUNTERS.get(device)
    return bool(have and have[-1].numel() >= count) or not _capturing(device)


def counters(device: torch.device, count: int, who: str) -> torch.Tensor:
    """At least `count` zeroed counters on `device`; inside a capture without enough of them a
    RuntimeError naming `who` (run a launch of that size eagerly first)."""
    have = _COUNTERS.setdefault(device, [])
    if have and have[-1].numel() >= count:
        return have[-1]
    if _capturing(device):
        raise RuntimeError(f"{who}: run a split launch once outside CUDA-graph capture first "
                           "(its counters are made then)")
    have.append(torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device))
    return have[-1]
