"""AsyncLLM: the asyncio frontend of an engine core running in its own process.

Tokenizing, validation, detokenizing and stop strings happen here; the core only sees token
ids. One background task reads engine outputs, feeds them through the OutputProcessor and
routes the RequestOutputs to per-request queues. Everything that can be wrong with a request
is found before anything is sent to the core, so a ValueError here never leaves a trace there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.engine.core import validate_request
from shoal.engine.core_client import EngineCoreClient, EngineDeadError
from shoal.engine.core_proc import CoreOutputs, Ready
from shoal.engine.core_types import EngineCoreRequest, SchedulerStats
from shoal.engine.engine_args import EngineArgs
from shoal.engine.input_processor import InputProcessor, ProcessedPrompt
from shoal.engine.output_processor import OutputKind, OutputProcessor
from shoal.loader import load_model
from shoal.metrics.stats import FinishedRequestStats, IterationStats, StatLogger
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | Mapping[str, Any] | Sequence[int] | ProcessedPrompt


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the server answers 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineRequestError(RuntimeError):
    """The engine failed this request (e.g. the model produced non-finite logits)."""


@dataclass
class _Child:
    parent_id: str
    arrival: float  # time.monotonic() in the frontend
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Parent:
    arrival: float
    num_prompt_tokens: int
    child_ids: list[str]
    queue: asyncio.Queue[RequestOutput | BaseException]
    num_generated: int = 0
    finish_reason: str | None = None


class RequestStream:
    """Async iterator over one request's outputs. `abort()` is safe to call at any time."""

    def __init__(self, engine: AsyncLLM, request_id: str,
                 queue: asyncio.Queue[RequestOutput | BaseException]):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error:
                raise EngineRequestError(item.error)
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, client: EngineCoreClient, ready: Ready,
                 loaded: Any, *, log_stats_interval: float = 10.0):
        self.engine_args = engine_args
        self.client = client
        self.ready = ready
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.config = engine_args.create_engine_config(loaded.hf_config)
        self.config.cache_config.num_blocks = ready.num_kv_blocks
        self.config.scheduler_config.max_model_len = ready.max_model_len
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.inputs = InputProcessor(self.tokenizer, ready.vocab_size, ready.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self._validate = functools.partial(validate_request, self.config, ready.vocab_size)
        self.max_waiting_requests = engine_args.max_waiting_requests
        self.max_num_seqs = self.config.scheduler_config.max_num_seqs
        self.stat_loggers: list[StatLogger] = []
        self.last_stats = SchedulerStats()
        self.errored: BaseException | None = None
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._dead_callbacks: list[Any] = []
        self._log_interval = log_stats_interval
        client.on_dead(self._on_engine_dead)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._output_handler(), name="output-handler"),
                       loop.create_task(self._log_loop(), name="stats-log")]

    @classmethod
    async def from_engine_args(cls, engine_args: EngineArgs, *, log_level: int = logging.INFO,
                               startup_timeout: float | None = None,
                               log_stats_interval: float = 10.0) -> AsyncLLM:
        client = await EngineCoreClient.start(engine_args, log_level=log_level)
        try:
            # The frontend needs the config and the tokenizer, never the weights; it reads
            # them while the engine process loads the model.
            loaded = await asyncio.to_thread(load_model, engine_args.model,
                                             tokenizer=engine_args.tokenizer,
                                             load_format="dummy")
            ready = await client.wait_ready(startup_timeout)
            return cls(engine_args, client, ready, loaded, log_stats_interval=log_stats_interval)
        except BaseException:
            await client.shutdown()
            raise

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    output_kind: OutputKind = OutputKind.FINAL_ONLY) -> RequestStream:
        """Validates and submits; raises ValueError (bad input), QueueFullError or
        EngineDeadError before anything reaches the core."""
        if self.errored is not None:
            raise EngineDeadError(str(self.errored))
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (got {priority!r})")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.inputs.process(prompt)
        self._check_queue(params.n)
        children = self.outputs.add_request(request_id, p.prompt, p.prompt_token_ids, params,
                                            output_kind)
        now = time.monotonic()
        reqs = [EngineCoreRequest(cid, p.prompt_token_ids, cp, now, priority, cache_salt)
                for cid, cp in children]
        try:
            for r in reqs:
                self._validate(r)
        except ValueError:
            self.outputs.abort(request_id)
            raise
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._parents[request_id] = _Parent(now, len(p.prompt_token_ids),
                                            [r.request_id for r in reqs], queue)
        for r in reqs:
            self._children[r.request_id] = _Child(request_id, now)
            self.client.add_request(r)
        return RequestStream(self, request_id, queue)

    def _check_queue(self, n: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        if n > self.max_num_seqs + limit:  # could never be admitted: retrying will not help
            raise ValueError(f"n ({n}) is larger than this server can ever hold "
                             f"(max_num_seqs + max_waiting_requests = {self.max_num_seqs + limit})")
        # Sequences beyond the batch-size limit wait; the last stats also count those kept
        # waiting by a full KV pool.
        waiting = max(len(self._children) + n - self.max_num_seqs,
                      self.last_stats.num_waiting + n if self.last_stats.num_waiting else 0)
        if waiting > limit:
            raise QueueFullError(
                f"the server is busy: {waiting} sequences would be waiting "
                f"(max_waiting_requests={limit}); retry later")

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0, *, cache_salt: str | None = None,
                       output_kind: OutputKind = OutputKind.FINAL_ONLY,
                       ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; stopping early (or cancellation) aborts it."""
        stream = self.add_request(request_id, prompt, sampling_params, priority=priority,
                                  cache_salt=cache_salt, output_kind=output_kind)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stops a request in the engine (its KV blocks are freed at once) and forgets it."""
        parent = self._parents.get(request_id)
        live = self.outputs.child_ids(request_id)
        self.outputs.abort(request_id)
        if parent is not None:
            self._finish(request_id, parent, "abort", time.monotonic(), None)
        if live and not self.client.dead:
            self.client.abort_requests(live)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    @property
    def is_healthy(self) -> bool:
        return self.errored is None and self.client.is_alive

    def on_dead(self, callback: Any) -> None:
        self._dead_callbacks.append(callback)

    async def reset_stats(self) -> None:
        await self.client.call_utility("reset_stats")

    async def check_health(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError("the engine process is not running")
        await self.client.call_utility("ping", timeout=5.0)

    # ---- outputs --------------------------------------------------------------------------
    async def _output_handler(self) -> None:
        try:
            while True:
                msg = await self.client.get_outputs()
                self._process(msg)
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # a bug here would hang every request: fail loudly instead
            logger.exception("the output handler failed")
            self._on_engine_dead(EngineDeadError(f"the output handler failed: {e}"))

    def _process(self, msg: CoreOutputs) -> None:
        now = time.monotonic()
        it = IterationStats(queue_times=list(msg.queue_times.values()))
        for cid, reason in msg.rejected.items():
            child = self._children.get(cid)
            if child is not None:
                self._reject(child.parent_id, reason)
        for o in msg.outputs.outputs:
            child = self._children.get(o.request_id)
            if child is None:
                continue
            if o.new_token_ids:
                if child.first_token is None:
                    child.first_token = now
                    it.time_to_first_tokens.append(now - child.arrival)
                elif child.last_token is not None:
                    it.inter_token_latencies.append(now - child.last_token)
                child.last_token = now
                parent = self._parents.get(child.parent_id)
                if parent is not None:
                    parent.num_generated += len(o.new_token_ids)
        results, to_abort = self.outputs.process_outputs(msg.outputs.outputs)
        if to_abort:
            self.client.abort_requests(to_abort)
        for out in results:
            parent = self._parents.get(out.request_id)
            if parent is None:
                continue
            for c in out.outputs:
                if c.finish_reason is not None:
                    parent.finish_reason = c.finish_reason
            parent.queue.put_nowait(out)
            if out.finished:
                reason = "error" if out.error else (parent.finish_reason or "stop")
                self._finish(out.request_id, parent, reason, now, it)
        if msg.outputs.stats is not None:
            self.last_stats = msg.outputs.stats
        for sl in self.stat_loggers:
            sl.record(msg.outputs.stats, it)

    def _finish(self, request_id: str, parent: _Parent, reason: str, now: float,
                it: IterationStats | None) -> None:
        self._parents.pop(request_id, None)
        for cid in parent.child_ids:
            self._children.pop(cid, None)
        stats = FinishedRequestStats(reason, now - parent.arrival, parent.num_prompt_tokens,
                                     parent.num_generated)
        if it is not None:
            it.finished.append(stats)
        else:
            for sl in self.stat_loggers:
                sl.record(None, IterationStats(finished=[stats]))

    def _reject(self, request_id: str, reason: str) -> None:
        parent = self._parents.get(request_id)
        if parent is None:
            return
        live = self.outputs.child_ids(request_id)
        self.outputs.abort(request_id)
        self.client.abort_requests(live)  # siblings the core did accept
        self._finish(request_id, parent, "error", time.monotonic(), None)
        parent.queue.put_nowait(ValueError(reason))

    def _fail_all(self, err: BaseException) -> None:
        self.errored = err
        for rid, parent in list(self._parents.items()):
            self.outputs.abort(rid)
            parent.queue.put_nowait(err)
        self._parents.clear()
        self._children.clear()

    def _on_engine_dead(self, err: EngineDeadError | None = None) -> None:
        self._fail_all(err or EngineDeadError("the engine process died"))
        for cb in self._dead_callbacks:
            try:
                cb()
            except Exception:
                logger.exception("engine-death callback failed")

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self._log_interval)
            for sl in self.stat_loggers:
                try:
                    sl.log()
                except Exception:
                    logger.exception("stat logger failed")

    # ---- shutdown -------------------------------------------------------------------------
    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.client.shutdown()
        if self.errored is None:
            self._fail_all(EngineDeadError("the engine is shut down"))
