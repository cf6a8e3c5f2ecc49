"""Scheduler-side glue between the device block pool and the tiers.

- Stores: the pool calls `on_device_evict` when `allocate` hands out a free block that still
  holds a cached prefix block; the block gets a pinned CPU slot and a store (device -> CPU)
  in this step's plan. The copy runs before the step's forward pass, so before the new owner
  writes into the block. This write-on-evict keeps copies to blocks actually displaced (a
  request finishing copies nothing), at the price of the copy sitting on the step that
  reuses the block.
- Loads: after a waiting request's device prefix hits, `stage` finds the following blocks in
  the tiers (disk hits are read and verified into the CPU tier right here) and pins them;
  once the scheduler has allocated device blocks, `commit` adds the CPU -> device copies.
- Pins are dropped at the next step's `begin_step`, when the runner has run the plan. A plan
  is only handed out with a non-empty schedule (the runner is not called otherwise); until
  then it stays pending and joins the next one."""

from __future__ import annotations

from shoal.engine.request import Request
from shoal.kv_cache.block_pool import BlockPool, KVBlock
from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.plan import KVTransferPlan
from shoal.kv_offload.request_params import skip_tiers
from shoal.kv_offload.store import TieredKVStore

Staged = list[tuple[BlockHash, int]]  # (hash, pinned CPU slot)


class KVOffloadConnector:
    def __init__(self, store: TieredKVStore, pool: BlockPool, block_size: int):
        self.store = store
        self.pool = pool
        self.block_size = block_size
        pool.on_evict = self.on_device_evict
        self._plan = KVTransferPlan()
        self._plan_pins: list[BlockHash] = []  # pinned for the plan being built
        self._inflight_pins: list[BlockHash] = []  # pinned for the plan the runner ran
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0

    def begin_step(self) -> None:
        """The previous plan has run: its CPU slots may be read, evicted and reused again."""
        if self._inflight_pins:
            self.store.fence()
            self.store.unpin(self._inflight_pins)
            self._inflight_pins = []

    # -- stores -------------------------------------------------------------------------------
    def on_device_evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is None or self.pool.cached.get(h) is not block:
            return  # a duplicate of a block still cached on the device: nothing is lost
        slot = self.store.reserve_for_device(h)
        if slot is None:
            return
        self._plan.stores.append((block.block_id, slot))
        self._plan_pins.append(h)
        self.num_stored_blocks += 1

    # -- loads --------------------------------------------------------------------------------
    def stage(self, req: Request, num_device_hits: int) -> Staged:
        """Tier hits for the blocks after the device hits, pinned in the CPU tier. At least
        one token is always left to compute (its logits are needed)."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes[num_device_hits:max_blocks]
        if not hashes:
            return []
        slots = self.store.stage(hashes, skip_tiers(req.sampling_params.kv_transfer_params))
        return list(zip(hashes, slots))

    def commit(self, staged: Staged, blocks: list[KVBlock]) -> None:
        """Loads the staged blocks into `blocks` (freshly allocated, in order)."""
        assert len(blocks) >= len(staged)
        for (h, slot), block in zip(staged, blocks):
            self._plan.loads.append((slot, block.block_id))
            self._plan_pins.append(h)
        self.num_loaded_blocks += len(staged)

    def cancel(self, staged: Staged) -> None:
        """The request could not be admitted: its staged blocks stay cached but unpinned."""
        self.store.unpin(h for h, _ in staged)

    # -- hand-off -----------------------------------------------------------------------------
    def take_plan(self, have_work: bool) -> KVTransferPlan | None:
        if not have_work or not self._plan:
            return None
        plan, self._plan = self._plan, KVTransferPlan()
        self._inflight_pins.extend(self._plan_pins)
        self._plan_pins = []
        return plan
