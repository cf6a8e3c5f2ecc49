"""`shoal router`: a cache-aware HTTP proxy in front of several shoal (or vLLM) servers.

It follows each backend's KV events (engine/kv_events.py) into one index of which engine
holds which prefix-cache block, and sends each completion or chat request to the engine
holding the longest prefix of its prompt; requests no engine has a prefix of go to the
least loaded one. An engine is a backend, or one data-parallel replica of it (each replica
publishes its events on its own endpoint; the request names it in X-data-parallel-rank)."""
