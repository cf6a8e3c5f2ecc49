"""Content hashes of full KV blocks, chained so a block's hash covers its whole prefix."""

from __future__ import annotations

from collections.abc import Sequence

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
                     extra: str | None = None) -> list[BlockHash]:
    """Extends `start` (hashes of the first len(start) blocks) in place to every full block of
    token_ids, and returns it: called every step for every request, so no copies."""
    hashes = start
    n_full = len(token_ids) // block_size
    for i in range(len(hashes), n_full):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes
