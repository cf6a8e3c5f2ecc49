"""Small host values onto the device without making the host wait for the device.

A blocking copy (`torch.tensor(..., device="cuda")`) waits for everything queued on the
stream, and CUDA may also wait before an asynchronous copy from pageable memory. With async
scheduling either one stalls the host until the step in flight ends. Staging through pinned
memory (torch's caching host allocator keeps the block until its copy has run) keeps the copy
asynchronous."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tensor_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype) on `device`, copied asynchronously."""
    return tensor_to_device(torch.tensor(values, dtype=dtype), device)
