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
    of one host buffer (the int64 lists, then a region of the int32 ones), split on the
    device: a split a region, whatever the number of lists (the host pays ~10-20 us a
    Python-issued torch call on a GPU machine, and a to_device a list makes three). Every
    list starts on a 16-byte boundary (padding between them): Triton specializes a kernel on
    its pointers' 16-byte alignment, so a list at another offset would compile it anew."""
    import numpy as np

    if any(dtype not in (torch.int64, torch.int32) for _, dtype in lists):
        raise ValueError("lists_to_device packs int64 and int32 lists, not "
                         f"{sorted({str(d) for _, d in lists})}")
    longs = [len(v) for v, d in lists if d == torch.int64]
    ints = [len(v) for v, d in lists if d == torch.int32]
    # (real, padding) sizes: int64 lists to an even count, int32 ones to a multiple of 4
    long_sizes = [n for m in longs for n in (m, -m % 2)]
    int_sizes = [n for m in ints for n in (m, -m % 4)]
    region = sum(int_sizes) // 2  # int64 words holding the int32 lists
    host = np.zeros(sum(long_sizes) + region, dtype=np.int64)
    packed = host[sum(long_sizes):].view(np.int32)
    at, at32 = 0, 0
    for values, dtype in lists:
        if dtype == torch.int64:
            host[at:at + len(values)] = values
            at += len(values) + len(values) % 2
        else:
            packed[at32:at32 + len(values)] = values
            at32 += len(values) + -len(values) % 4
    parts = tensor_to_device(torch.from_numpy(host), device).split(long_sizes + [region])
    region_t = parts[-1]
    long_parts = iter(parts[:-1:2])
    if region_t.shape[0] == 0:  # (an empty tensor's view may not change the dtype)
        int_parts = iter([torch.empty(0, dtype=torch.int32, device=region_t.device)] * len(ints))
    else:
        int_parts = iter(region_t.view(torch.int32).split(int_sizes)[::2])
    return [next(long_parts) if dtype == torch.int64 else next(int_parts)
            for _, dtype in lists]
