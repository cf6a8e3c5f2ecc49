"""P2PConnector: engine to engine over TCP (transport.py), no broker; on one host the bytes
themselves go through /dev/shm files (kv_shared_memory, default true: shm_buffers.py).

Producer (kv_producer / kv_both): a request sent with kv_transfer_params
{"do_remote_decode": true} has its prompt's KV read out once its last prompt chunk has run
(a KVSave in that step's plan: one host buffer, rows.gather_rows), kept for `kv_ttl_s`
seconds (at most `kv_buffer_bytes` in all, oldest dropped first) and served once to whoever
asks for its key. The request's final output carries the kv_transfer_params a consumer needs:
{"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id" (the key),
"remote_num_tokens"}. A hybrid's (linear-attention layers) KV ends at the last block end
before the prompt's last token, with the linear layers' states there: the consumer computes
the rest, as after a prefix hit (a prompt within one block sends nothing: no params). With
several tensor-parallel ranks each reads out its own heads and rank 0 gathers them into one
payload of every head (tp_rows.py), which a consumer of any TP size slices on receipt (a
hybrid's states too: they go in the model's order of channels and heads, states.py). With
speculative decoding by a drafter of layers, the drafter's rows of the same tokens follow
the target's in the payload (draft_rows.py), sent only to a consumer that asks for them
(its fetch says "draft": true): one without a drafter, or older, gets the target's rows alone.

Consumer (kv_consumer / kv_both): a waiting request sent with those params is fetched on one
of `kv_fetch_workers` background threads (it waits unadmitted meanwhile, the others keep
stepping); at most `kv_fetch_buffer_bytes` of fetched KV waits for admission at once (more
fetches start as it is admitted). The prompt's token ids are checked against a hash the
producer sends, and the rows go into the request's blocks in the step that admits it (with
several ranks on this host the fetched bytes land in shared memory and the step carries a
handle: each rank reads its own heads there, shared.py); its drafter's rows with them, or
zeros where the payload has none that fit (draft_rows.py: a cold drafter, exact tokens). Any
failure (the producer gone, the key expired or served already, another prompt, a timeout of
`kv_fetch_timeout_s` on a receive) means the prompt is recomputed, never an error."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shoal.core.kv_connector_plan import KVConnectorPlan, KVLayout, KVLoad, KVSave
from shoal.core.request import Request
from shoal.kv_transfer.base import EngineInfo, KVConnector
from shoal.kv_transfer.config import KVTransferConfig
from shoal.kv_transfer.payload import KVPayload, host_buffer
from shoal.kv_transfer.shared import SegmentMaker, to_ranks
from shoal.kv_transfer.shm_buffers import is_loopback
from shoal.kv_transfer.transport import KVServer, Reply, fetch

logger = logging.getLogger(__name__)


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(),
                           digest_size=16).hexdigest()


@dataclass
class _Kept:
    """A producer's prompt KV awaiting its fetch."""

    expiry: float
    digest: str
    payload: KVPayload


@dataclass
class _Fetched:
    num_tokens: int
    payload: KVPayload | None  # None: failed, or used already
    seconds: float = 0.0


def _positive(extra: dict[str, Any], key: str, default: float, kind: type = float) -> Any:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} must be a "
                         f"number > 0 (got {value!r})")
    return kind(value)


class P2PConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, engine: EngineInfo):
        super().__init__(config, engine)
        extra = config.extra
        self.ttl_s = _positive(extra, "kv_ttl_s", 120.0)
        self.buffer_bytes = _positive(extra, "kv_buffer_bytes", 4 << 30, int)
        self.timeout_s = _positive(extra, "kv_fetch_timeout_s", 30.0)
        self.fetch_workers = _positive(extra, "kv_fetch_workers", 8, int)
        self.fetch_buffer_bytes = _positive(extra, "kv_fetch_buffer_bytes", 8 << 30, int)
        # a producer and a consumer on one host hand the bytes over in /dev/shm files, not
        # through loopback TCP (transport.py; either side may turn it off)
        self.shared_memory = extra.get("kv_shared_memory", True)
        if not isinstance(self.shared_memory, bool):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.kv_shared_memory "
                             f"must be true or false (got {self.shared_memory!r})")
        self._plan = KVConnectorPlan()
        self._store: OrderedDict[str, _Kept] = OrderedDict()  # producer: key -> kept KV
        self._stored_bytes = 0
        self._lock = threading.Lock()
        self._pending_saves: dict[str, str] = {}  # key -> prompt digest
        self._params: dict[int, dict[str, Any]] = {}  # serial -> params for its client
        self.server: KVServer | None = None
        if config.produces:
            self.server = KVServer(config.kv_ip, config.kv_port, self._serve)
        # consumer: request id -> fetch in flight / done
        self._pool = ThreadPoolExecutor(self.fetch_workers, thread_name_prefix="kv-fetch") \
            if config.consumes else None
        self._fetching: dict[str, Future] = {}
        self._fetched: dict[str, _Fetched] = {}
        self._segments = SegmentMaker()  # (used only when the ranks share this host's memory)
        self.num_loaded = self.num_failed = 0  # consumer: requests loaded / recomputed
        self.num_dropped = 0  # producer: kept KV dropped unfetched (TTL, buffer full)
        self.bytes_fetched, self.fetch_seconds = 0, 0.0  # consumer: successful fetches

    # ---- producer ---------------------------------------------------------------------------
    def _save_point(self, num_prompt_tokens: int) -> int:
        """The tokens whose KV a prompt's consumer gets: all of them; with linear-attention
        layers those up to the last block end before the prompt's last token, whose states
        the producer's prefix caching keeps (a block-end state, as a prefix hit restores
        one) and where the consumer resumes (0: the prompt ends inside its first block)."""
        if not self.engine.linear_states:
            return num_prompt_tokens
        bs = self.engine.block_size
        return (num_prompt_tokens - 1) // bs * bs

    def scheduled(self, req: Request, start: int, num_tokens: int, block_ids: list[int],
                  group_block_ids: tuple[list[int], ...] = ()) -> None:
        params = req.sampling_params.kv_transfer_params
        if (not self.config.produces or not params or not params.get("do_remote_decode")
                or req.serial in self._params):  # (saved already: its tokens are known)
            return
        n = self._save_point(req.num_prompt_tokens)
        # saved in the step that computes its last token (a hybrid's: or that starts right
        # after it, reading the state there from a prefix hit)
        lowest = start if self.engine.linear_states else start + 1
        if not n or not lowest <= n <= start + num_tokens:
            return
        key = f"{uuid.uuid4().hex}-{req.serial}"
        self._pending_saves[key] = prompt_digest(req.prompt_token_ids[:n])
        self._plan.saves.append(KVSave(req.serial, key, list(block_ids), n,
                                       [list(ids) for ids in group_block_ids]))
        assert self.server is not None
        self._params[req.serial] = {
            "do_remote_prefill": True, "remote_host": self.config.kv_ip,
            "remote_port": self.server.port, "remote_request_id": key,
            "remote_num_tokens": n}

    def saved(self, payloads: dict[str, KVPayload]) -> None:
        now = time.monotonic()
        with self._lock:
            for key, payload in payloads.items():
                digest = self._pending_saves.pop(key, "")
                self._store[key] = _Kept(now + self.ttl_s, digest, payload)
                self._stored_bytes += payload.nbytes
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._store:
            key, kept = next(iter(self._store.items()))
            if kept.expiry > now and self._stored_bytes <= self.buffer_bytes:
                return
            del self._store[key]
            kept.payload.wait()  # (its readout may still be landing in the buffer let go)
            self._stored_bytes -= kept.payload.nbytes
            self.num_dropped += 1
            logger.warning("KV of %s dropped unfetched (%s)", key, "its kv_ttl_s passed"
                           if kept.expiry <= now else "kv_buffer_bytes is full")

    def _serve(self, request: Any) -> Reply:
        key = request.get("key") if isinstance(request, dict) else None
        with self._lock:
            self._expire(time.monotonic())
            kept = self._store.pop(key, None) if isinstance(key, str) else None
            if kept is not None:
                self._stored_bytes -= kept.payload.nbytes
        if kept is None:
            return Reply({"error": f"no KV kept under {key!r} (expired, served, or never "
                                   "made)"})
        payload = kept.payload
        layout, data = payload.layout, payload.data
        if layout.draft is not None and request.get("draft") is not True:
            # a consumer without a drafter, or built before drafter rows travelled (it sends
            # no "draft"): the target's rows alone, which come first, as it expects them
            layout = replace(layout, draft=None)
            data = memoryview(data).cast("B")[:layout.nbytes]
        share = self.shared_memory and request.get("shared") is True
        return Reply({"digest": kept.digest, "layout": layout.to_wire()}, data, payload.wait,
                     share)

    def transfer_params(self, req: Request) -> dict[str, Any] | None:
        return self._params.pop(req.serial, None)

    # ---- consumer ---------------------------------------------------------------------------
    def lookup(self, req: Request, num_computed: int) -> int | None:
        params = req.sampling_params.kv_transfer_params
        if not self.config.consumes or not params or not params.get("do_remote_prefill"):
            return 0
        rid = req.request_id
        got = self._fetched.get(rid)
        if got is None:
            future = self._fetching.get(rid)
            if future is None:
                if self._held_bytes() >= self.fetch_buffer_bytes:
                    return None  # fetched KV awaiting admission fills the budget: wait
                assert self._pool is not None
                self._fetching[rid] = self._pool.submit(self._fetch, params,
                                                        req.prompt_token_ids)
                return None
            if not future.done():
                return None
            got = self._fetched[rid] = future.result()
            del self._fetching[rid]
            if got.payload is None:
                self.num_failed += 1
            else:
                self.bytes_fetched += got.payload.nbytes
                self.fetch_seconds += got.seconds
        if got.payload is None:
            return 0
        n = got.num_tokens
        if got.payload.layout.states:  # the states follow token n - 1: the load ends there
            return n - num_computed if num_computed < n < req.num_prompt_tokens else 0
        usable = min(n, req.num_prompt_tokens - 1)
        return max(0, usable - num_computed)

    def _held_bytes(self) -> int:
        return sum(f.payload.nbytes for f in self._fetched.values() if f.payload is not None)

    def _fetch(self, params: dict[str, Any], prompt: list[int]) -> _Fetched:
        t0 = time.perf_counter()
        try:
            ask: dict[str, Any] = {"key": params["remote_request_id"]}
            if self.engine.drafter_kv:  # (only then: the drafter's bytes would go unused)
                ask["draft"] = True
            host = str(params["remote_host"])
            # (a file named by a producer of another host is never opened: loopback only)
            header, data = fetch(host, int(params["remote_port"]), ask, self.timeout_s,
                                 alloc=self._alloc,
                                 shared=self.shared_memory and is_loopback(host))
            if not isinstance(header, dict) or "error" in header or data is None:
                raise ValueError(header.get("error") if isinstance(header, dict)
                                 else "a malformed reply")
            layout = KVLayout.from_wire(header.get("layout"))
            n = layout.num_tokens
            if n > len(prompt) or header.get("digest") != prompt_digest(prompt[:n]):
                raise ValueError("the producer's KV is of another prompt")
            if len(data) != layout.nbytes:
                raise ValueError(f"{len(data)} bytes for a layout of {layout.nbytes}")
            if self.engine.kv_rows is not None:  # another model's KV: refused here, not
                self.engine.kv_rows.check(layout, self.engine.tensor_parallel_size)  # in a step
            return _Fetched(n, KVPayload(layout, data), time.perf_counter() - t0)
        except Exception as e:  # the prompt is recomputed instead
            logger.warning("KV fetch from %s:%s failed (%s: %s): recomputing the prompt",
                           params.get("remote_host"), params.get("remote_port"),
                           type(e).__name__, e)
            return _Fetched(0, None)

    @property
    def _ranks_via_shared_memory(self) -> int:
        """How many ranks read fetched KV out of shared memory (0: it is broadcast, or
        there is one rank). A consumer has one pipeline stage (factory.py)."""
        tp = self.engine.tensor_parallel_size
        return tp if self.engine.ranks_share_memory and tp > 1 else 0

    def _alloc(self, nbytes: int) -> memoryview:
        if self._ranks_via_shared_memory:  # the ranks map it: nothing rides in the broadcast
            view = self._segments.segment(nbytes)
            if view is not None:
                return view
        # pinned: the device copies are asynchronous (one rank)
        return host_buffer(nbytes, pinned=self.engine.pin_memory)

    def admitted(self, req: Request, start: int, num_tokens: int, block_ids: list[int],
                 group_block_ids: tuple[list[int], ...] = ()) -> None:
        got = self._fetched.get(req.request_id)
        if got is None or got.payload is None or num_tokens <= 0:
            return
        payload = got.payload
        data = payload.data
        if self._ranks_via_shared_memory:
            data = to_ranks(data, self._ranks_via_shared_memory)  # a handle, not the bytes
        self._plan.loads.append(KVLoad(req.serial, list(block_ids), start, num_tokens,
                                       payload.layout, data,
                                       [list(ids) for ids in group_block_ids]))
        got.payload = None  # used: a recompute after preemption computes instead
        self.num_loaded += 1

    def finished(self, req: Request) -> None:
        self._fetched.pop(req.request_id, None)
        future = self._fetching.pop(req.request_id, None)
        if future is not None:
            future.cancel()
        self._params.pop(req.serial, None)

    def stats(self) -> dict[str, Any]:
        """Counters for logs and benchmarks."""
        return {"loaded": self.num_loaded, "failed": self.num_failed,
                "dropped": self.num_dropped, "bytes_fetched": self.bytes_fetched,
                "fetch_seconds": self.fetch_seconds, "kept_bytes": self._stored_bytes,
                "fetch_gb_per_s": (self.bytes_fetched / self.fetch_seconds / 1e9
                                   if self.fetch_seconds else None)}

    # ---- both -------------------------------------------------------------------------------
    def step_plan(self) -> KVConnectorPlan | None:
        plan, self._plan = self._plan, KVConnectorPlan()
        return plan or None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._segments.sweep()
