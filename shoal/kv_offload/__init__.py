"""Tiered KV offloading: device blocks -> CPU memory -> disk, found by prefix hash.

Turn it on with engine arguments (the same names as `shoal serve` flags):

    LLM(..., kv_offloading_size=8,                  # GiB of host memory (pinned on CUDA)
        kv_offloading_disk_path="/var/cache/shoal",  # optional disk tier below it...
        kv_offloading_disk_size=100,                 # ...of this many GiB
        kv_offloading_policy="lru")                  # "arc" or "pkg.module:Class" too

How blocks move (see connector.py, store.py and loads.py):
- A cached device block that the pool hands to a new owner is first copied to the CPU tier
  (write-on-evict); a block the CPU tier evicts continues to disk (write-back, on a
  background writer thread). `TieredKVStore.shutdown()` writes the CPU tier down when the
  engine stops, and `control.persist(core)` pushes the device prefix cache down too, so a
  restart on the same disk path finds them (the index is rebuilt by scanning).
- A waiting request's blocks after its device prefix hits are looked up in the tiers. CPU
  hits are pinned at once; disk hits are read into reserved CPU slots by a pool of reader
  threads (files verified there: a damaged one is deleted and the request recomputes from
  that block) while the scheduler leaves the request waiting and keeps the others running.
  Then the blocks are copied into fresh device blocks before the forward pass of the step
  that admits the request. They count in num_cached_tokens.
- Per request, SamplingParams(kv_transfer_params={"skip_tiers": ["disk"]}) keeps a request
  from reading a tier (request_params.py).
- Disk files live under a directory named after the model, dtype, block size, per-layer
  shape and layout version (layout.StoreKey); every file header repeats that key's digest
  and carries an xxhash of the payload.
- Statistics: TieredKVStore.stats() -> KVOffloadStats (queries, hits, bytes and seconds
  loaded and stored, usage, per tier; the disk tier's load seconds are its readers' busy
  wall time, so bytes / seconds is the read bandwidth it delivered).

Kept import-free so light modules (request_params) can be imported without torch."""
