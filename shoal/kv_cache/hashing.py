"""Content hashes of full KV blocks, chained so a block's hash covers its whole prefix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

BlockHash = bytes

# The root of every chain; extra keys (a cache salt, later a LoRA id) are mixed into the first
# block so tenants with different salts never share a block.
_ROOT = b"shoal-kv-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: str | None = None) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(parent if parent is not None else _ROOT)
    if parent is None and extra:
        h.update(extra.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, start: list[BlockHash],
                     extra: str | None = None, images: Sequence[Any] | None = None,
                     ) -> list[BlockHash]:
    """Extends `start` (hashes of the first len(start) blocks) in place to every full block of
    token_ids, and returns it: called every step for every request, so no copies. Same bytes
    as hash_block per block; a long prompt converts its tokens to int64 once, not per block.
    images: the request's MultiModalFeatures; a block mixes in the identifier of each image
    whose span it overlaps (their placeholder tokens are alike whatever the image)."""
    if images:
        return _hash_blocks_with_images(token_ids, block_size, start, extra, images)
    hashes = start
    n_full = len(token_ids) // block_size
    first = len(hashes)
    if first >= n_full:
        return hashes
    raw = np.asarray(token_ids[first * block_size:n_full * block_size], dtype=np.int64).tobytes()
    width = block_size * 8
    for j in range(n_full - first):
        h = xxhash.xxh3_128()
        parent = hashes[-1] if hashes else None
        h.update(parent if parent is not None else _ROOT)
        if parent is None and extra:
            h.update(extra.encode())
        h.update(raw[j * width:(j + 1) * width])
        hashes.append(h.digest())
    return hashes


def _hash_blocks_with_images(token_ids: Sequence[int], block_size: int,
                             hashes: list[BlockHash], extra: str | None,
                             images: Sequence[Any]) -> list[BlockHash]:
    for j in range(len(hashes), len(token_ids) // block_size):
        lo, hi = j * block_size, (j + 1) * block_size
        h = xxhash.xxh3_128()
        parent = hashes[-1] if hashes else None
        h.update(parent if parent is not None else _ROOT)
        if parent is None and extra:
            h.update(extra.encode())
        h.update(np.asarray(token_ids[lo:hi], dtype=np.int64).tobytes())
        for f in images:
            if f.offset < hi and f.offset + f.length > lo:
                h.update(f.identifier.encode())
        hashes.append(h.digest())
    return hashes
