"""P2PConnector: engine to engine over TCP (transport.py), no broker.

Producer (kv_producer / kv_both): a request sent with kv_transfer_params
{"do_remote_decode": true} has its prompt's KV read out once its last prompt chunk has run
(a KVSave in that step's plan), kept in host memory under a fresh key for `kv_ttl_s`
seconds (at most `kv_buffer_bytes` in all, oldest dropped first) and served once to whoever
asks for the key. The request's final output carries the kv_transfer_params a consumer needs:
{"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id" (the key),
"remote_num_tokens"}.

Consumer (kv_consumer / kv_both): a waiting request sent with those params fetches the KV in
the background (it waits meanwhile, the others run); the prompt's token ids are checked
against a hash the producer sends, and the rows go into the request's blocks in the step that
admits it. Any failure (the producer gone, the key expired, another prompt) means the
prompt is recomputed, never an error."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from shoal.core.kv_connector_plan import KVConnectorPlan, KVLoad, KVSave
from shoal.core.request import Request
from shoal.kv_transfer.base import EngineInfo, KVConnector
from shoal.kv_transfer.config import KVTransferConfig
from shoal.kv_transfer.transport import KVServer, fetch

logger = logging.getLogger(__name__)


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(),
                           digest_size=16).hexdigest()


class _Fetched:
    def __init__(self, num_tokens: int, payload: bytes | None):
        self.num_tokens, self.payload = num_tokens, payload  # payload None: failed or used


class P2PConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, engine: EngineInfo):
        super().__init__(config, engine)
        extra = config.extra
        self.ttl_s = float(extra.get("kv_ttl_s", 120.0))
        self.buffer_bytes = int(extra.get("kv_buffer_bytes", 4 << 30))
        self.timeout_s = float(extra.get("kv_fetch_timeout_s", 30.0))
        self._plan = KVConnectorPlan()
        # producer: key -> (expiry, prompt digest, num tokens, payload)
        self._store: OrderedDict[str, tuple[float, str, int, bytes]] = OrderedDict()
        self._stored_bytes = 0
        self._lock = threading.Lock()
        self._pending_saves: dict[str, tuple[str, int]] = {}  # key -> (digest, tokens)
        self._params: dict[int, dict[str, Any]] = {}  # serial -> params for its client
        self.server: KVServer | None = None
        if config.produces:
            self.server = KVServer(config.kv_ip, config.kv_port, self._serve)
        # consumer: request id -> fetch in flight / done
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-fetch") \
            if config.consumes else None
        self._fetching: dict[str, Future] = {}
        self._fetched: dict[str, _Fetched] = {}
        self.num_loaded = self.num_failed = 0  # consumer: requests loaded / recomputed

    # ---- producer ---------------------------------------------------------------------------
    def scheduled(self, req: Request, start: int, num_tokens: int,
                  block_ids: list[int]) -> None:
        params = req.sampling_params.kv_transfer_params
        n = req.num_prompt_tokens
        if (not self.config.produces or not params or not params.get("do_remote_decode")
                or not start < n <= start + num_tokens):
            return
        key = f"{uuid.uuid4().hex}-{req.serial}"
        digest = prompt_digest(req.prompt_token_ids)
        self._pending_saves[key] = (digest, n)
        self._plan.saves.append(KVSave(req.serial, key, list(block_ids), n))
        assert self.server is not None
        self._params[req.serial] = {
            "do_remote_prefill": True, "remote_host": self.config.kv_ip,
            "remote_port": self.server.port, "remote_request_id": key,
            "remote_num_tokens": n}

    def saved(self, payloads: dict[str, bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            for key, payload in payloads.items():
                digest, n = self._pending_saves.pop(key, ("", 0))
                self._store[key] = (now + self.ttl_s, digest, n, payload)
                self._stored_bytes += len(payload)
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._store:
            key, (expiry, _, _, payload) = next(iter(self._store.items()))
            if expiry > now and self._stored_bytes <= self.buffer_bytes:
                return
            del self._store[key]
            self._stored_bytes -= len(payload)

    def _serve(self, request: Any) -> Any:
        key = request.get("key") if isinstance(request, dict) else None
        with self._lock:
            self._expire(time.monotonic())
            entry = self._store.pop(key, None) if isinstance(key, str) else None
            if entry is not None:
                self._stored_bytes -= len(entry[3])
        if entry is None:
            return {"error": f"no KV kept under {key!r} (expired, served, or never made)"}
        _, digest, n, payload = entry
        return {"digest": digest, "num_tokens": n, "payload": payload}

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
        if got.payload is None:
            return 0
        usable = min(got.num_tokens, req.num_prompt_tokens - 1)
        return max(0, usable - num_computed)

    def _fetch(self, params: dict[str, Any], prompt: list[int]) -> _Fetched:
        try:
            reply = fetch(str(params["remote_host"]), int(params["remote_port"]),
                          {"key": params["remote_request_id"]}, self.timeout_s)
            if "error" in reply:
                raise ValueError(reply["error"])
            n = int(reply["num_tokens"])
            if n > len(prompt) or reply["digest"] != prompt_digest(prompt[:n]):
                raise ValueError("the producer's KV is of another prompt")
            return _Fetched(n, reply["payload"])
        except Exception as e:  # the prompt is recomputed instead
            logger.warning("KV fetch from %s:%s failed (%s): recomputing the prompt",
                           params.get("remote_host"), params.get("remote_port"), e)
            return _Fetched(0, None)

    def admitted(self, req: Request, start: int, num_tokens: int, block_ids: list[int]) -> None:
        got = self._fetched.get(req.request_id)
        if got is None or got.payload is None or num_tokens <= 0:
            return
        self._plan.loads.append(KVLoad(req.serial, list(block_ids), start, num_tokens,
                                       got.payload))
        got.payload = None  # used: a recompute after preemption computes instead
        self.num_loaded += 1

    def finished(self, req: Request) -> None:
        self._fetched.pop(req.request_id, None)
        future = self._fetching.pop(req.request_id, None)
        if future is not None:
            future.cancel()
        self._params.pop(req.serial, None)

    # ---- both -------------------------------------------------------------------------------
    def step_plan(self) -> KVConnectorPlan | None:
        plan, self._plan = self._plan, KVConnectorPlan()
        return plan or None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
