"""Tiered KV offloading: device blocks -> CPU memory -> disk (-> any tier listed in
lower_tiers.py), found by prefix hash.

Turn it on with engine arguments (the same names as `shoal serve` flags):

    LLM(..., kv_offloading_size=8,                  # GiB of host memory (pinned on CUDA)
        kv_offloading_disk_path="/var/cache/shoal",  # optional disk tier below it...
        kv_offloading_disk_size=100,                 # ...of this many GiB
        kv_offloading_policy="lru")                  # "arc" or "pkg.module:Class" too

Who does what:
- factory.py builds the store (store.py: the CPU tier, then the lower tiers) and the
  transfer (transfer.py: device <-> CPU-tier copies); the engine core gives the store to the
  scheduler and the transfer to the model runner. Where a block's pages differ in shape (a
  pool partitioned between KV cache groups, DeepSeek-V4; latent rows beside indexer keys,
  DeepSeek-V3.2) the CPU tier has slots of each copy group's size (grouped_cpu_tier.py) and
  the copies go by group (grouped_transfer.py).
- The scheduler's connector (connector.py) decides the copies of a step: they travel to the
  runner in SchedulerOutput.kv_transfers, and back comes ModelRunnerOutput.kv_transfers_done
  once they have completed; only then are their CPU slots unpinned (and filled ones counted
  as holding their block). The scheduler and the store import no torch and never wait on
  the device.

How blocks move (see connector.py, store.py and loads.py):
- A cached device block that the pool hands to a new owner is first copied to the CPU tier
  (write-on-evict); a block the CPU tier evicts continues to the lower tiers (write-back; the
  disk tier writes on a background thread). `TieredKVStore.shutdown()` writes the CPU tier
  down when the engine stops, and `control.persist(core)` pushes the device prefix cache down
  too, so a restart on the same disk path finds them (the index is rebuilt by scanning).
- A waiting request's blocks after its device prefix hits are looked up in the tiers. CPU
  hits are pinned at once; lower-tier hits are read into reserved CPU slots in the background
  (the disk tier's reader threads verify each file: a damaged one is deleted and the request
  recomputes from that block) while the scheduler leaves the request waiting and keeps the
  others running. Then the blocks are copied into fresh device blocks before the forward
  pass of the step that admits the request. They count in num_cached_tokens.
- Per request, SamplingParams(kv_transfer_params={"skip_tiers": ["disk"]}) keeps a request
  from reading a tier (request_params.py).
- Disk files live under a directory named after the model, dtype, block size, per-layer
  shape (a partitioned pool's: each group's block bytes) and layout version
  (layout.StoreKey); every file header repeats that key's digest
  and carries an xxhash of the payload.
- Statistics: TieredKVStore.stats() -> KVOffloadStats (queries, hits, bytes and seconds
  loaded and stored, usage, per tier; a lower tier's load seconds are its readers' busy
  wall time, so bytes / seconds is the read bandwidth it delivered).

Kept import-free so light modules (request_params) can be imported without torch."""
