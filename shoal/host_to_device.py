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


def lists_to_device(lists: Sequence[tuple[Sequence[int], torch.dtype]],
                    device: torch.device | str) -> list[torch.Tensor]:
    """Each (values, dtype) as a tensor on `device` (int64 or int32), all through ONE copy
    of one host buffer: the int64 lists, then the int32 ones in a region of their own, split
    on the device (a split and a view a region: the host pays ~10-20 us a Python-issued
    torch call on a GPU machine, and a to_device a list makes three)."""
    import numpy as np

    if any(dtype not in (torch.int64, torch.int32) for _, dtype in lists):
        raise ValueError("lists_to_device packs int64 and int32 lists, not "
                         f"{sorted({str(d) for _, d in lists})}")
    longs = [len(v) for v, d in lists if d == torch.int64]
    ints = [len(v) for v, d in lists if d == torch.int32]
    region = -(-sum(ints) // 2)  # int64 words holding the int32 lists
    host = np.empty(sum(longs) + region, dtype=np.int64)
    packed = host[sum(longs):].view(np.int32)
    at, at32 = 0, 0
    for values, dtype in lists:
        if dtype == torch.int64:
            host[at:at + len(values)] = values
            at += len(values)
        else:
            packed[at32:at32 + len(values)] = values
            at32 += len(values)
    parts = list(tensor_to_device(torch.from_numpy(host), device).split(longs + [region]))
    region_t = parts.pop()
    if region_t.shape[0] == 0:  # (an empty tensor's view may not change the dtype)
        region_t = torch.empty(0, dtype=torch.int64, device=region_t.device)
    odd = [1] if sum(ints) % 2 else []  # the region's last half word is padding
    int_parts = iter(region_t.view(torch.int32).split(ints + odd) if ints else ())
    long_parts = iter(parts)
    return [next(long_parts) if dtype == torch.int64 else next(int_parts)
            for _, dtype in lists]
