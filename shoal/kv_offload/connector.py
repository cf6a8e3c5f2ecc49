"""Scheduler-side glue between the device block pool and the tiers.

- Stores: the pool calls `on_device_evict` when `allocate` hands out a free block that still
  holds a cached prefix block; the block gets a pinned CPU slot and a store (device -> CPU)
  in this step's plan. The copy runs before the step's forward pass, so before the new owner
  writes into the block. This write-on-evict keeps copies to blocks actually displaced (a
  request finishing copies nothing), at the price of the copy sitting on the step that
  reuses the block.
- Loads: after a waiting request's device prefix hits, `stage` finds the following blocks in
  the tiers and pins them in the CPU tier; once the scheduler has allocated device blocks,
  `commit` adds the CPU -> device copies. Lower-tier hits not in the CPU tier yet are read
  (and verified) in the background: `stage` returns None ("ask again next step") and the
  scheduler goes on with the other requests, so a disk load never stalls their decoding.
  `abandon` lets go of a request that will not come back for its blocks.
- Several KV cache groups (linear-attention hybrids; DeepSeek-V4's compressed entries,
  windows and open groups, each group in a partition of the pool of its own:
  shoal/kv_cache/manager.py): every group's blocks are stored under their group's key (the
  prefix hash, tagged), as they leave the device. A tier hit of n blocks needs what the step
  after it reads of each group: every block of a group that keeps the whole context (of a
  sparse one, those that hold entries), and of a group that drops blocks only those from
  its first needed one on (a sliding window's last blocks; a linear-state group's block
  n - 1, the state after the hit's last token). The longest such n is staged, and the
  dropping groups' earlier entries stay empty. A block that the device still holds, free
  and cached, while its neighbours of other groups left (so the device hit stopped before
  it), is copied into the CPU tier by the same plan, ahead of the loads (_snapshot).
- Every plan handed out has an id. The CPU slots it reads or writes stay pinned, and the
  slots it fills count as garbage, until `transfers_done` hears from the model runner (via
  ModelRunnerOutput and the scheduler's update) that its copies have completed. So nothing
  here waits for the device, and with async scheduling a plan launched with step N+1 holds
  its own pins while step N's are released. A plan is only handed out with a non-empty
  schedule (the runner is not called otherwise); until then it stays pending and joins the
  next one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from shoal.core.kv_transfer_plan import KVTransferPlan
from shoal.core.request import Request
from shoal.kv_cache.block_pool import BlockPool, KVBlock
from shoal.kv_cache.block_tables import BlockTables
from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.loads import Staging
from shoal.kv_offload.request_params import skip_tiers
from shoal.kv_offload.store import TieredKVStore


class StagedBlock(NamedTuple):
    key: BlockHash  # the block's key in the tiers: its prefix hash, tagged with its group
    slot: int  # its pinned CPU slot
    group: int  # the KV cache group (index of its table in the KV manager)
    index: int  # its entry in the request's table of that group


@dataclass
class Staged:
    """A waiting request's tier hits, pinned in the CPU tier: the prefix blocks they extend
    the device hits by, and the blocks to load (one per group and block; a linear-state
    group only the last)."""

    blocks: list[StagedBlock] = field(default_factory=list)
    num_blocks: int = 0

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def __iter__(self):
        return iter(self.blocks)

# A step with nothing to run while requests wait for disk reads blocks this long at most for
# one to end: the engine loop would otherwise spin in Python, and the reader threads, which
# need the GIL between system calls, read about 3x slower (benchmarked on 8 threads).
IDLE_WAIT_S = 0.002


@dataclass
class _PlanHolds:
    """What one plan keeps from the tiers until its copies are done."""

    pins: list[BlockHash] = field(default_factory=list)  # CPU slots it reads or writes
    fills: list[BlockHash] = field(default_factory=list)  # CPU slots its stores fill


class KVOffloadConnector:
    def __init__(self, store: TieredKVStore, pool: BlockPool, block_size: int,
                 tables: Sequence[BlockTables] = ()):
        """tables: the KV manager's per-group tables (none or one: a model of one group)."""
        self.store = store
        self.pool = pool
        self.block_size = block_size
        self.tables = list(tables) if len(tables) > 1 else []
        pool.on_evict = self.on_device_evict
        self._plan = KVTransferPlan()
        self._holds = _PlanHolds()  # of the plan being built
        self._next_plan_id = 0
        self._in_flight: dict[int, _PlanHolds] = {}  # plans handed out, copies not done
        # Requests whose lower-tier hits are being read, by id; each staging holds its pins.
        self._deferred: dict[str, tuple[Request, Staging]] = {}
        # False: stage() waits for disk reads itself (for callers that cannot come back).
        self.defer_loads = True
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0

    def begin_step(self) -> None:
        """Lower-tier reads that ended are settled (their blocks pinned for the requests
        waiting). Deferred requests that finished meanwhile are abandoned: a missed abandon()
        call must not hold CPU slots forever."""
        self.store.collect()
        for rid, (req, _) in list(self._deferred.items()):
            if req.status.is_finished:
                self.abandon(rid)

    def transfers_done(self, plan_ids: list[int]) -> None:
        """The model runner reports these plans' copies complete: the slots they filled hold
        their blocks now, and their CPU slots may be read, evicted and reused again."""
        for plan_id in plan_ids:
            holds = self._in_flight.pop(plan_id)
            self.store.filled(holds.fills)
            self.store.unpin(holds.pins)

    def transfers_failed(self, plan_ids: list[int]) -> None:
        """These plans' steps raised: whether their copies ran is unknown, so the slots they
        were to fill are discarded (never served, never written down) and their pins go."""
        for plan_id in plan_ids:
            holds = self._in_flight.pop(plan_id, None)
            if holds is not None:
                self.store.discard(holds.fills)
                self.store.unpin(holds.pins)

    def discard(self, hashes: list[BlockHash]) -> None:
        """Blocks of a request that produced non-finite values: out of every tier."""
        self.store.discard(hashes)

    @property
    def num_plans_in_flight(self) -> int:
        return len(self._in_flight)

    # -- stores -------------------------------------------------------------------------------
    def on_device_evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is None or self.pool.cached.get(h) is not block:
            return  # a duplicate of a block still cached on the device: nothing is lost
        slot = self.store.reserve_for_device(h)
        if slot is None:
            return
        self._plan.stores.append((block.block_id, slot))
        self._holds.pins.append(h)
        self._holds.fills.append(h)
        self.num_stored_blocks += 1

    # -- loads --------------------------------------------------------------------------------
    def stage(self, req: Request, num_device_hits: int) -> Staged | None:
        """Tier hits for the blocks after the device hits, pinned in the CPU tier, or None while
        some of them are being read from a lower tier: the request should wait and ask again
        in a later step (the reads go on meanwhile; other requests can be admitted). Never
        blocks on a read. A block that arrives damaged or not at all ends the hits there. At
        least one token is always left to compute (its logits are needed)."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        skip = skip_tiers(req.sampling_params.kv_transfer_params)
        wanted = self._wanted(req, num_device_hits, max_blocks, skip)
        hashes = [w.key for w in wanted]
        _, prev = self._deferred.pop(req.request_id, (None, None))
        if prev is not None and not prev.ready:
            self.store.collect()  # (begin_step collected too; reads may have ended since)
            if not prev.ready:
                self._deferred[req.request_id] = (req, prev)
                return None
        # After a deferral, walk again: the device hits may have moved, and a block that
        # failed to arrive ends the hits. The lookups were counted on the first walk, and
        # the old staging's pins are dropped only now, so nothing it read is evicted before.
        st = self.store.begin_stage(hashes, skip, count=prev is None)
        if prev is not None:
            self.store.release(prev)
        if not st.ready and not self.defer_loads:
            st = self.store.finish_stage(st, hashes, skip)
        if not st.ready:
            self._deferred[req.request_id] = (req, st)
            return None
        slots = self.store.slots(st)
        if self.tables and len(slots) < len(wanted):  # a block arrived damaged: without it,
            self.store.release(st)  # the hit's end lacks what a group needs: nothing loads
            return Staged()
        blocks = [w._replace(slot=s) for w, s in zip(wanted, slots)]
        if not blocks:
            return Staged()
        return Staged(blocks, max(b.index for b in blocks) + 1 - num_device_hits)

    def _wanted(self, req: Request, num_device_hits: int, max_blocks: int,
                skip: Sequence[str]) -> list[StagedBlock]:
        """The blocks to stage, slots unknown yet: with one group, its blocks after the
        device hits; with several, what each group needs of the longest hit the tiers (or
        the device's free cached blocks: _snapshot) hold whole. Lookups only (the walk in
        begin_stage pins), but for the snapshots."""
        hashes = req.block_hashes
        if not self.tables:
            return [StagedBlock(h, -1, 0, num_device_hits + i)
                    for i, h in enumerate(hashes[num_device_hits:max_blocks])]
        if self.store.cpu.name in skip:  # every tier's blocks come through the CPU tier
            return []
        whole = [(g, t) for g, t in enumerate(self.tables) if not t.sliding]
        dropping = [(g, t) for g, t in enumerate(self.tables) if t.sliding]
        end = num_device_hits
        while end < max_blocks and all(self._available(t.key(hashes[end]), skip)
                                       for g, t in whole if self._has_entry(g, t, end)):
            end += 1
        while end > num_device_hits and not all(
                self._available(t.key(hashes[i]), skip)
                for g, t in dropping for i in self._needed(g, t, end, num_device_hits)):
            end -= 1
        if end == num_device_hits:
            return []
        needed = [set(self._needed(g, t, end, num_device_hits))
                  for g, t in enumerate(self.tables)]
        out = [StagedBlock(t.key(hashes[i]), -1, g, i) for i in range(num_device_hits, end)
               for g, t in enumerate(self.tables) if i in needed[g]]
        for b in out:
            if not self.store.holds(b.key, skip):
                self._snapshot(b.key)
        return out

    def _has_entry(self, group: int, tables: BlockTables, index: int) -> bool:
        """Whether entry `index` of the group's tables holds a block: all of the first
        group's do; a sparse group's (DeepSeek-V4's entries of groups longer than a block)
        only where its spec says (kv_cache/manager.py _SparseTables)."""
        return group == 0 or tables.group.spec.holds_block(index, self.block_size)

    def _needed(self, group: int, tables: BlockTables, end: int,
                num_device_hits: int) -> list[int]:
        """The entries of the group's table that a hit of `end` blocks loads: those after
        the device hits, from the first that the next step reads on (a sliding window's
        blocks in its window, a linear-state group's last block), where the table holds
        one."""
        first = max(num_device_hits,
                    tables.group.first_needed_block(end * self.block_size, self.block_size))
        return [i for i in range(first, end) if self._has_entry(group, tables, i)]

    def _available(self, key: BlockHash, skip: Sequence[str]) -> bool:
        """A tier holds the block, or the device does in a free cached block (_snapshot)."""
        if self.store.holds(key, skip):
            return True
        block = self.pool.cached.get(key)
        return block is not None and block.ref_cnt == 0

    def _snapshot(self, key: BlockHash) -> None:
        """A block a tier hit needs that only the device still holds, in a free cached block
        (the other groups' blocks of its prefix left the device, so the device hit stops
        before it): into the CPU tier through this step's plan, whose stores run before its
        loads. A block no request holds was computed by an earlier step (one published for
        a step not run yet is held by its request). Without room in the CPU tier the staging
        walk stops there and nothing loads."""
        block = self.pool.cached.get(key)
        if block is not None:
            self.on_device_evict(block)

    def abandon(self, request_id: str) -> None:
        """The request was aborted or finished while waiting: drop what is reserved or being
        read for it. Reads in flight finish anyway; their blocks stay cached, unpinned."""
        entry = self._deferred.pop(request_id, None)
        if entry is not None:
            self.store.release(entry[1])

    @property
    def num_deferred(self) -> int:
        """Requests waiting for lower-tier reads."""
        return len(self._deferred)

    def is_deferred(self, request_id: str) -> bool:
        """The request asked before and waits for reads (its lookups were counted then)."""
        return request_id in self._deferred

    def commit(self, staged: Staged, block_at: Callable[[int, int], KVBlock | None]) -> None:
        """Loads the staged blocks into the request's freshly allocated blocks: block_at(group,
        index) is the block at that entry of its table."""
        for b in staged:
            block = block_at(b.group, b.index)
            assert block is not None, f"no block allocated for {b}"
            self._plan.loads.append((b.slot, block.block_id))
            self._holds.pins.append(b.key)
        self.num_loaded_blocks += len(staged.blocks)

    def cancel(self, staged: Staged) -> None:
        """The request could not be admitted: its staged blocks stay cached but unpinned."""
        self.store.unpin(b.key for b in staged)

    # -- hand-off -----------------------------------------------------------------------------
    def take_plan(self, have_work: bool) -> KVTransferPlan | None:
        """This step's plan, when the step runs anything (the runner reports its id back in
        ModelRunnerOutput.kv_transfers_done). With nothing to run, a step that has requests
        waiting on reads waits a little for one instead of spinning."""
        if not have_work:
            if self._deferred:
                self.store.wait_for_a_load(IDLE_WAIT_S)
            return None
        if not self._plan:
            return None
        plan, self._plan = self._plan, KVTransferPlan()
        plan.plan_id = self._next_plan_id
        self._next_plan_id += 1
        self._in_flight[plan.plan_id] = self._holds
        self._holds = _PlanHolds()
        return plan
