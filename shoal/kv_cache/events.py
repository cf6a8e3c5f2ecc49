"""KV cache events (vLLM's kv_events): which prefix-cache blocks an engine gained and lost.

The block pool calls an `EventSink` where a block becomes the cached copy of its hash, where
it stops being one, and where the whole cache is reset; the engine drains the sink once per
step and publishes the batch (engine/kv_events.py). With events off the pool holds no sink,
and its hot path pays one `is not None` test.

Only the first KV cache group's keys are reported (the plain content hashes a router can
compute from token ids, kv_cache/hashing.py); other groups' keys carry a one-byte tag."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from shoal.kv_cache.hashing import BlockHash

HASH_BYTES = 16  # an untagged xxh3_128 digest: the first group's key


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Blocks newly cached, in prefix order: block_hashes[0]'s parent is parent_block_hash
    (None: the prefix's first block, or not known); token_ids: the blocks' tokens, when known
    (empty otherwise)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = "GPU"


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                       tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events, the payload of one published message."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


class EventSink:
    """Events of the current step, in the order they happened. Stored hashes wait in `_open`
    until the KV manager names the request they belong to (`attribute`), which gives them
    their parent and tokens; any left unnamed are reported bare."""

    def __init__(self, block_size: int, medium: str = "GPU"):
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVEvent] = []
        self._open: list[BlockHash] = []

    # ---- called by the block pool ----------------------------------------------------------
    def stored(self, block_hash: BlockHash) -> None:
        if len(block_hash) == HASH_BYTES:
            self._open.append(block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        if len(block_hash) != HASH_BYTES:
            return
        self._close()
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # an allocation's evictions: one event
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium=self.medium))

    def cleared(self) -> None:
        self._close()
        self.events.append(AllBlocksCleared())

    @property
    def pending(self) -> bool:
        return bool(self.events or self._open)

    # ---- called by the KV manager and the engine -------------------------------------------
    def attribute(self, request: Any) -> None:
        """The open hashes were just published for `request` (a shoal.core.request.Request):
        each run of consecutive blocks becomes one BlockStored with its parent and tokens."""
        if not self._open:
            return
        hashes = request.block_hashes
        pending, self._open = self._open, []
        i = 0
        while i < len(pending):
            at = _find(hashes, pending[i])
            if at < 0:  # not this request's: reported bare
                self._bare([pending[i]])
                i += 1
                continue
            n = 1
            while (i + n < len(pending) and at + n < len(hashes)
                   and hashes[at + n] == pending[i + n]):
                n += 1
            bs = self.block_size
            lora = getattr(request, "lora", None)
            self.events.append(BlockStored(
                pending[i:i + n], hashes[at - 1] if at else None,
                list(request.all_token_ids[at * bs:(at + n) * bs]), bs,
                lora.lora_int_id if lora is not None else None, self.medium))
            i += n

    def take(self) -> list[KVEvent]:
        """The step's events, and a fresh buffer for the next."""
        self._close()
        events, self.events = self.events, []
        return events

    def _close(self) -> None:
        if self._open:
            self._bare(self._open)
            self._open = []

    def _bare(self, hashes: list[BlockHash]) -> None:
        self.events.append(BlockStored(list(hashes), None, [], self.block_size,
                                       medium=self.medium))


def _find(hashes: list[BlockHash], h: BlockHash) -> int:
    """The index of h in a request's hashes, searched from the end: freshly cached blocks
    are the newest full ones."""
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] == h:
            return i
    return -1


def new_batch(events: list[KVEvent], dp_rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(time.time(), events, dp_rank)
