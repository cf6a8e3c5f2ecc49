"""What one offloaded block holds, and the identity that keeps stored blocks from being used
by a model or configuration they do not belong to."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import torch
import xxhash

from shoal.kv_cache.hashing import BlockHash

# A KV cache group's key in the prefix cache and the tiers is the 16-byte prefix hash, with
# the group's index appended as one byte for every group but the first
# (shoal/kv_cache/block_tables.py BlockTables.key).
HASH_BYTES = 16

# Bump when the byte layout of a block or the disk file format changes: old files are then
# in another directory and never read.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class BlockLayout:
    """Every layer's cache planes for `block_size` tokens: a [num_layers, planes,
    block_size * Hk * D] tensor per block (the device's per-layer [planes, block_size, Hk, D]
    slice, flattened). planes is 2 (K and V) for ordinary attention, 1 for latent attention
    (MLA), whose one plane holds each token's compressed latent.

    A partitioned pool (DeepSeek-V4: KV cache groups whose layers' rows differ, each with pages
    of its own, shoal/worker/kv_cache_tensors.py) has a block of one group per block id: its
    payload is that group's pages back to back, as bytes (group_bytes[g] of them; see
    grouped); num_layers, layer_shape and dtype then describe the largest group's as one
    uint8 layer, and value_dtype is the cache's."""

    num_layers: int
    layer_shape: tuple[int, ...]  # one layer of one block: (planes, block_size, Hk, D)
    dtype: torch.dtype
    group_bytes: tuple[int, ...] = ()  # a partitioned pool's block bytes per group
    value_dtype: torch.dtype | None = None  # a partitioned pool's cache dtype

    @classmethod
    def grouped(cls, group_bytes: tuple[int, ...], block_size: int,
                value_dtype: torch.dtype) -> BlockLayout:
        """The layout of a partitioned pool whose group g's block holds group_bytes[g]."""
        widest = max(group_bytes)
        if widest % block_size:
            raise ValueError(f"a KV page of {widest} bytes is not a whole row per token of "
                             f"{block_size}-token blocks")
        return cls(1, (1, block_size, 1, widest // block_size), torch.uint8,
                   tuple(group_bytes), value_dtype)

    def group_of(self, key: BlockHash) -> int:
        """The KV cache group a tier key belongs to (0 for a layout of one kind)."""
        if not self.group_bytes or len(key) <= HASH_BYTES:
            return 0
        group = key[HASH_BYTES]
        if group >= len(self.group_bytes):
            raise ValueError(f"key {key.hex()} names KV cache group {group}; the layout has "
                             f"{len(self.group_bytes)}")
        return group

    def payload_bytes(self, key: BlockHash) -> int:
        """The bytes of the block stored under `key`."""
        return self.group_bytes[self.group_of(key)] if self.group_bytes else self.nbytes

    @property
    def planes(self) -> int:
        return self.layer_shape[0]

    @property
    def block_size(self) -> int:
        return self.layer_shape[1]

    @property
    def elems_per_kv(self) -> int:
        n = 1
        for d in self.layer_shape[1:]:
            n *= d
        return n

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.planes, self.elems_per_kv)

    @property
    def nbytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.planes * self.elems_per_kv * elem


@dataclass(frozen=True)
class StoreKey:
    """Everything that must match for a stored block to be valid: the model's weights, the
    dtype, the block size and the per-layer shape (a partitioned pool's: each group's block
    bytes), and the layout version."""

    model_id: str  # source path plus a fingerprint of the weight files (see factory.py)
    dtype: str
    block_size: int
    num_layers: int
    layer_shape: tuple[int, ...]
    layout_version: int = LAYOUT_VERSION
    group_bytes: tuple[int, ...] = ()

    @classmethod
    def of(cls, model_id: str, layout: BlockLayout) -> StoreKey:
        dtype = layout.value_dtype or layout.dtype
        return cls(model_id, str(dtype).removeprefix("torch."), layout.block_size,
                   layout.num_layers, tuple(layout.layer_shape),
                   group_bytes=tuple(layout.group_bytes))

    def to_json(self) -> str:
        fields = asdict(self)
        if not self.group_bytes:  # (one kind of block: the key of the layouts before groups)
            del fields["group_bytes"]
        return json.dumps(fields, sort_keys=True)

    def digest(self) -> bytes:
        """16 bytes, written in every file header and in the directory name."""
        return xxhash.xxh3_128(self.to_json().encode()).digest()

    def dirname(self) -> str:
        tail = self.model_id.rstrip("/").split("/")[-1].split("#")[0]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:40] or "model"
        return f"{slug}-{self.dtype}-bs{self.block_size}-v{self.layout_version}-{self.digest().hex()[:16]}"
