"""A fixed pool of KV blocks: ref counts, an O(1) free queue in eviction order, and the
prefix-cache map from content hash to block.

A freed block keeps its hash and stays findable until it is handed out again, so a later
request with the same prefix can take it back from the free queue (prefix-cache hit).

A partitioned pool (KV cache groups with pages of their own, core/kv_cache_spec.py
pool_partitions) holds one run of block ids per group, ids from 1 (0 is the null page every
group's tensors keep), each run with its own free queue: a group allocates only from its
own; the prefix-cache map, the events and the eviction hook stay the pool's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shoal.kv_cache.events import EventSink
from shoal.kv_cache.hashing import BlockHash


class KVBlock:
    __slots__ = ("block_id", "part", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int, part: int = 0):
        self.block_id = block_id
        self.part = part  # its run of a partitioned pool (its free queue)
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed), append at
    the tail, remove from the middle in O(1) when a cached block is reused."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = block
        self._tail.prev = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise ValueError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev is None or block.next is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self):
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 partitions: Sequence[tuple[int, int]] = ()):
        """partitions: (first id, count) of each run of a partitioned pool (num_blocks their
        sum); none: one run of ids [0, num_blocks)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        runs = tuple(partitions) or ((0, num_blocks),)
        if sum(n for _, n in runs) != num_blocks or min(n for _, n in runs) < 1:
            raise ValueError(f"partitions {runs} must be non-empty and hold num_blocks "
                             f"({num_blocks}) blocks")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        by_run = [[KVBlock(first + i, part) for i in range(n)]
                  for part, (first, n) in enumerate(runs)]
        self.blocks = [b for run in by_run for b in run]
        self.sizes = tuple(n for _, n in runs)
        self.free_queues = [FreeBlockQueue(run) for run in by_run]
        self.free_queue = self.free_queues[0]  # the only one of an unpartitioned pool
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        # KV offloading (shoal/kv_offload/connector.py) saves a cached block's content before
        # `allocate` hands the block to a new owner.
        self.on_evict: Callable[[KVBlock], None] | None = None
        self.events: EventSink | None = None  # KV events (kv_cache/events.py), when enabled

    @property
    def num_free_blocks(self) -> int:
        return sum(q.num_free for q in self.free_queues)

    def num_free(self, part: int = 0) -> int:
        return self.free_queues[part].num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests (of the fullest run: the one that stops
        admissions); cached blocks nobody holds count as free."""
        return max(1.0 - q.num_free / n for q, n in zip(self.free_queues, self.sizes))

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int, part: int = 0) -> list[KVBlock]:
        queue = self.free_queues[part]
        if n > queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, only {queue.num_free} free")
        out = []
        for _ in range(n):
            block = queue.popleft()
            if block.block_hash is not None:  # evict its cached content
                if self.on_evict is not None:
                    self.on_evict(block)
                self.uncache_block(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queues[b.part].remove(b)
            b.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops a reference; blocks reaching zero go to the tail of the free queue in the
        given order (callers pass a request's blocks last-first, so a prefix's tail is evicted
        before its head)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queues[b.part].append(b)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # First writer wins; a duplicate computed concurrently simply stays uncached.
        if self.cached.setdefault(block_hash, block) is block and self.events is not None:
            self.events.stored(block_hash)

    def uncache_block(self, block: KVBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
