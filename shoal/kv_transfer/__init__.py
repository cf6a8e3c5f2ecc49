"""Prefill/decode disaggregation: a request's prompt KV computed by one engine (the producer)
and read by another (the consumer), as vLLM's KV connectors do.

    shoal serve MODEL --kv-transfer-config '{"kv_connector": "P2PConnector",
        "kv_role": "kv_producer", "kv_port": 14579}'                   # the prefill engine
    shoal serve MODEL --kv-transfer-config '{"kv_connector": "P2PConnector",
        "kv_role": "kv_consumer"}'                                      # the decode engine
    shoal proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Who does what (vLLM's split of a connector into a scheduler side and a worker side):
- base.py: the connector interface. Scheduler side (torch-free): how many tokens of a
  waiting request an external source holds (`lookup`: None while it is being fetched), what
  the step loads into the request's fresh blocks and what it saves (`step_plan`, which travels
  to the runner in SchedulerOutput.kv_connector), and what the client is told when a
  producer's request finishes (its kv_transfer_params). Worker side (rows.py, torch): the
  runner writes a plan's loads into the paged cache before the forward pass and reads its
  saves out after it.
- p2p.py: P2PConnector. The producer keeps each finished prompt's KV (token-major rows of
  every paged layer, all KV heads, read out once into one host buffer: payload.py, rows.py;
  a hybrid's linear layers send their recurrent states at a block end instead: states.py;
  DeepSeek-V4's compressed layers their entries, placed by entry index: entries.py;
  several tensor-parallel ranks gather their heads on rank 0: tp_rows.py; a speculative
  drafter's layers, an MTP or EAGLE head or a draft model, their rows after the target's,
  read out once the drafter has mirrored the prompt: draft_rows.py)
  for a while and serves it over TCP (transport.py: a small msgpack header, then the raw
  bytes, received straight into a recycled host buffer, pinned on CUDA; on one host the
  consumer copies them out of the producer's /dev/shm file instead: shm_buffers.py); the
  consumer fetches it on background threads while the request waits unadmitted (the others keep
  stepping), then the admitting step writes it into the request's blocks with one indexed
  copy per layer, whatever their block size, each tensor-parallel rank taking its own
  heads (ranks of the mp executor map the fetched bytes from shared memory instead of
  receiving them all in the step's broadcast: shared.py). A consumer that cannot fetch (the
  producer died, the KV expired or was served, another prompt or model) recomputes the prompt
  instead.
- factory.py builds a connector by name or `module:Class`; config.py reads kv_transfer_config.

Built on the same hand-off as KV offloading: what the runner must copy travels in the
SchedulerOutput, and the scheduler never waits on the device or the network."""
