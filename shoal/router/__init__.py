"""`shoal router`: a cache-aware HTTP proxy in front of several shoal (or vLLM) servers.

It follows each backend's KV events (engine/kv_events.py) into one index of which backend
holds which prefix-cache block, and sends each completion or chat request to the backend
holding the longest prefix of its prompt; requests no backend has a prefix of go to the
least loaded one."""
