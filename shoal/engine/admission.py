"""Admitting waiting requests (the scheduler's): in queue order while the step has budget, a
free sequence slot and KV blocks; each one's prefix hits (device blocks, then blocks of the
KV tiers staged in the CPU tier to load into fresh device blocks) are taken, and the rest of
its prompt is computed, in chunks when it does not fit one step."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from shoal.config import SchedulerConfig
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import NewRequestData, SchedulerOutput
from shoal.engine.encoder_schedule import EncoderPlan, EncoderSchedule
from shoal.engine.waiting_queue import WaitingQueue
from shoal.kv_cache.block_pool import KVBlock
from shoal.kv_cache.manager import KVCacheManager
from shoal.kv_offload.connector import KVOffloadConnector, Staged
from shoal.kv_transfer.base import KVConnector
from shoal.lora_request import LoRARequest


@dataclass
class StepPlan:
    """The step being scheduled: what runs, the budget left, and what happened."""

    budget: int
    allow_drafts: bool = True  # False while a step is in flight (async scheduling)
    max_requests: int = sys.maxsize  # micro-batches: this step's share of the requests
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)  # id -> tokens
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: bool = False
    # The request being handled, for the error when scheduling raises (scheduler.py)
    current: Request | None = None

    def add(self, req: Request, n: int) -> None:
        self.scheduled[req.request_id] = (req, n)
        self.budget -= n


@dataclass
class _Cached:
    """A waiting request's prefix hits: device blocks, then tier blocks staged in the CPU
    tier (to load into fresh device blocks)."""

    device_hits: list[KVBlock] = field(default_factory=list)
    num_hit_tokens: int = 0  # tokens of the device hits
    staged: Staged = field(default_factory=Staged)
    external: int = 0  # tokens after the hits that the KV connector supplies


class Admission:
    pause: Any = None  # engine/pause.py: GenerationPause, set by the engine core

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 offload: KVOffloadConnector | None, waiting: WaitingQueue,
                 running: list[Request], encoders: EncoderSchedule | None = None,
                 connector: KVConnector | None = None):
        self.config, self.kv, self.offload = config, kv, offload
        self.encoders = encoders  # images: their encoder outputs (encoder_schedule.py)
        self.connector = connector  # KV from and for other engines (shoal/kv_transfer)
        self.waiting, self.running = waiting, running
        self.block_size = kv.block_size
        # LoRA adapters pinned to a device slot (engine/core_lora.py): fewer than max_loras
        self.pinned_loras: set[int] = set()

    def schedule_waiting(self, step: StepPlan) -> None:
        """Waiting requests in queue order, while there is budget, a free sequence slot and
        blocks. One whose KV is still on its way from a tier is passed over this step."""
        deferred: list[Request] = []  # ask again next step, in the same order
        loras = self._running_loras()
        try:
            while (len(self.waiting) and step.budget > 0
                   and len(self.running) < self.config.max_num_seqs
                   and len(step.scheduled) < step.max_requests):
                req = step.current = self.waiting.peek()
                if self.pause is not None and self.pause.holds(req):  # arrived while paused
                    deferred.append(self.waiting.pop())
                    continue
                if req.num_pending_tokens or req.suspect:
                    # preempted while a step was in flight: its token is not known yet; or a
                    # suspect of a failed step, which is only admitted alone
                    break
                if req.structured is not None and not req.structured.is_ready():
                    deferred.append(self.waiting.pop())  # its grammar is still compiling
                    continue
                if req.lora is not None and not self._lora_fits(req.lora, loras):
                    deferred.append(self.waiting.pop())  # every adapter slot is taken
                    continue
                cached = self.find_cached(req)
                if cached is None:
                    deferred.append(self.waiting.pop())
                    continue
                if not self.admit(req, cached, step):
                    break
                if req.lora is not None:
                    loras[req.lora.lora_int_id] = req.lora.cache_key
            step.current = None
        finally:  # (also when scheduling raises: they must not leave the queue)
            for req in reversed(deferred):
                self.waiting.push_front(req)

    @property
    def max_loras(self) -> int:
        return self.config.max_loras

    def _running_loras(self) -> dict[int, str]:
        """The adapters of the running requests (id -> cache_key: folder and version): a step
        runs them all, in at most max_loras device slots."""
        if not self.config.max_loras:
            return {}
        return {r.lora.lora_int_id: r.lora.cache_key for r in self.running if r.lora}

    def _lora_fits(self, lora: LoRARequest, running: dict[int, str]) -> bool:
        """A request of another adapter waits while every slot is taken; one whose id runs
        with another folder or version of its files waits for it to end (an id names one
        adapter in a step).
        Pinned adapters have their slots: the others share the slots left."""
        held = running.get(lora.lora_int_id)
        if held is not None:
            return held == lora.cache_key
        pinned = self.pinned_loras
        if lora.lora_int_id in pinned:
            return True
        unpinned = sum(1 for lora_id in running if lora_id not in pinned)
        return unpinned < self.max_loras - len(pinned)

    def find_cached(self, req: Request) -> _Cached | None:
        """The request's prefix hits: device blocks, then tier blocks pinned in the CPU tier
        (KV offloading); None while some tier blocks are still being read."""
        if req.sampling_params.prompt_logprobs is not None:
            return _Cached()  # every prompt position's logits are needed: compute them all
        # A request asking again after a deferral had its query counted the first time.
        count = self.offload is None or not self.offload.is_deferred(req.request_id)
        hits, n_hit = self.kv.get_computed_blocks(req, count=count)
        if (req.mm_features and self.encoders is not None and self.encoders.whole_spans
                and self.encoders.span_start(req, n_hit) != n_hit):
            return _Cached()  # the hit ends inside an image, which must run whole: recompute
        if self.connector is not None:  # another engine's KV (disaggregated prefill)
            external = self.connector.lookup(req, n_hit)
            if external is None:
                return None  # still being fetched
            if external:
                return _Cached(hits, n_hit, external=external)
        staged = Staged()
        if self.offload is not None:
            found = self.offload.stage(req, len(hits))
            if found is None:
                return None
            staged = found
        return _Cached(hits, n_hit, staged)

    def admit(self, req: Request, cached: _Cached, step: StepPlan) -> bool:
        """Allocates the waiting request's blocks and makes it running; False (nothing
        changed) when they do not fit."""
        # tier hits and the connector's tokens: loaded, not computed
        n_loaded = cached.staged.num_blocks * self.block_size + cached.external
        n = req.num_tokens - cached.num_hit_tokens - n_loaded
        images = None
        if n > step.budget and not self.config.enable_chunked_prefill:
            new_blocks = None  # the whole prompt must fit in one step
        else:
            n = min(n, step.budget)
            if req.mm_features and self.encoders is not None:
                n, images = self.encoders.fit(req, n_loaded + cached.num_hit_tokens, n)
            new_blocks = None if n <= 0 else self.kv.allocate_slots(
                req, n_loaded + n, cached.device_hits, loaded_blocks=cached.staged.num_blocks,
                loaded_tokens=cached.external)
        if new_blocks is None:
            if cached.staged:
                self.offload.cancel(cached.staged)
            return False
        if cached.staged:
            self.offload.commit(cached.staged, functools.partial(self.kv.block_at,
                                                                 req.request_id))
        if cached.external:
            self.connector.admitted(req, cached.num_hit_tokens, cached.external,
                                    self.kv.block_ids(req.request_id),
                                    *self._other_groups(req))
        n_hit = cached.num_hit_tokens + n_loaded
        req.num_computed_tokens = n_hit
        self.waiting.pop()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_hit
            req.first_scheduled_time = time.monotonic()
        if req.status == RequestStatus.WAITING:
            step.new_requests.append(NewRequestData(
                req.request_id, req.serial, req.prompt_token_ids, req.sampling_params,
                req.eos_token_ids, list(req.output_token_ids), lora=req.lora,
                mm_features=req.mm_features))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.add(step, req, n, images)
        return True

    def fit_images(self, req: Request, n: int) -> tuple[int, EncoderPlan | None]:
        """A running request's n next tokens, cut before an image the step cannot encode."""
        if not req.mm_features or self.encoders is None:
            return n, None
        return self.encoders.fit(req, req.num_computed_tokens, n)

    def reset_images(self) -> None:
        if self.encoders is not None:
            self.encoders.reset()

    def release_images(self, req: Request) -> None:
        if req.mm_features and self.encoders is not None:
            self.encoders.release(req)

    def on_end(self, req: Request) -> None:
        """The request ended: its images and anything the KV connector holds for it."""
        self.release_images(req)
        if self.connector is not None:
            self.connector.finished(req)

    def add(self, step: StepPlan, req: Request, n: int, images: EncoderPlan | None) -> None:
        if images is not None:
            self.encoders.commit(req, images)
        if self.connector is not None:  # (a producer saves a prompt once it has run whole)
            self.connector.scheduled(req, req.num_computed_tokens, n,
                                     self.kv.block_ids(req.request_id),
                                     *self._other_groups(req))
        step.add(req, n)

    def _other_groups(self, req: Request) -> tuple:
        """The connector's group_block_ids argument, passed only for a model of several KV
        cache groups: a connector class written for one group (module:Class) keeps working."""
        groups = self.kv.group_block_ids(req.request_id)
        return (groups,) if groups else ()

    def fill_output(self, out: SchedulerOutput) -> None:
        """The step's encoder work for images and its KV connector plan."""
        if self.encoders is not None:
            out.encoder_free, out.encoder_inputs = self.encoders.take()
        if self.connector is not None:
            out.kv_connector = self.connector.step_plan()

    def admit_head(self, req: Request, step: StepPlan) -> bool:
        """Admits the request at the head of the queue if its hits are ready and it fits."""
        step.current = req
        cached = self.find_cached(req)
        admitted = cached is not None and self.admit(req, cached, step)
        step.current = None
        return admitted
