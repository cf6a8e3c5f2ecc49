"""How the split-K attention kernels (paged_decode, mla_decode, mla_sparse,
v4_decode_attention) size and cut a row's keys: the device's streaming multiprocessors (the
prefills' occupancy heuristics read it too), how many splits fill the GPU, and the whole key
tiles one split reads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def sm_count(device: torch.device, elsewhere: int) -> int:
    """Streaming multiprocessors of a CUDA device; `elsewhere` on other devices (the
    interpreter: what the caller's heuristic should assume there)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return elsewhere


def split_count(programs: int, max_keys: int, min_split_keys: int, max_splits: int,
                num_sms: int) -> int:
    """Splits of each program's keys, a power of two (few combine-kernel variants): enough
    programs for one to two waves over num_sms, but no split shorter than min_split_keys of
    the most keys a row may read, and at most max_splits. From shapes only, so the count a
    CUDA graph was captured with holds for every replay: shorter rows leave splits empty."""
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    useful = triton.cdiv(max(max_keys, 1), min_split_keys)
    n = max(1, min(want, useful, max_splits))
    return 1 << (n.bit_length() - 1)


@triton.jit
def split_range(start, end, split, num_splits, BLOCK_N: tl.constexpr):
    """[lo, hi): split `split`'s share of keys [start, end) in whole tiles of BLOCK_N, so only
    a split's last tile is ragged (late splits of a short row are empty)."""
    per = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per
    return lo, tl.minimum(lo + per, end)
