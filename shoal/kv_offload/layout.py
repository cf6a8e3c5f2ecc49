"""What one offloaded block holds, and the identity that keeps stored blocks from being used
by a model or configuration they do not belong to."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import torch
import xxhash

# Bump when the byte layout of a block or the disk file format changes: old files are then
# in another directory and never read.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class BlockLayout:
    """Every layer's cache planes for `block_size` tokens: a [num_layers, planes,
    block_size * Hk * D] tensor per block (the device's per-layer [planes, block_size, Hk, D]
    slice, flattened). planes is 2 (K and V) for ordinary attention, 1 for latent attention
    (MLA), whose one plane holds each token's compressed latent."""

    num_layers: int
    layer_shape: tuple[int, ...]  # one layer of one block: (planes, block_size, Hk, D)
    dtype: torch.dtype

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
    dtype, the block size and the per-layer shape, and the layout version."""

    model_id: str  # source path plus a fingerprint of the weight files (see factory.py)
    dtype: str
    block_size: int
    num_layers: int
    layer_shape: tuple[int, ...]
    layout_version: int = LAYOUT_VERSION

    @classmethod
    def of(cls, model_id: str, layout: BlockLayout) -> StoreKey:
        return cls(model_id, str(layout.dtype).removeprefix("torch."), layout.block_size,
                   layout.num_layers, tuple(layout.layer_shape))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def digest(self) -> bytes:
        """16 bytes, written in every file header and in the directory name."""
        return xxhash.xxh3_128(self.to_json().encode()).digest()

    def dirname(self) -> str:
        tail = self.model_id.rstrip("/").split("/")[-1].split("#")[0]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:40] or "model"
        return f"{slug}-{self.dtype}-bs{self.block_size}-v{self.layout_version}-{self.digest().hex()[:16]}"
