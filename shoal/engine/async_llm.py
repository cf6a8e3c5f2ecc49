"""AsyncLLM: the asyncio frontend of an engine core running in its own process.

Tokenizing and validation (InputProcessor), detokenizing and stop strings (OutputProcessor)
happen here; the core only sees token ids. One background task reads engine outputs and hands
them to the OutputProcessor, which delivers each request's RequestOutputs to that request's
stream. Everything that can be wrong with a request is found before anything is sent to the
core, so a ValueError here never leaves a trace there. The frontend loads the tokenizer only:
the limits requests are checked against come in the engine's ready message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from shoal.core.errors import ErrorCode
from shoal.core.types import SchedulerStats
from shoal.engine.core_client import EngineCoreClient
from shoal.engine.core_messages import CoreOutputs, Ready
from shoal.engine.dp_client import check_data_parallel_rank
from shoal.engine.engine_args import EngineArgs
from shoal.engine.input_processor import InputProcessor, PromptType
from shoal.engine.mm_frontend import MultiModalFrontend
from shoal.engine.output_processor import OutputKind, OutputProcessor
from shoal.engine.request_errors import EngineDeadError, request_error
from shoal.engine.start_client import start_engine_client
from shoal.lora_request import LoRARequest
from shoal.metrics.stats import IterationStats, StatLogger, merge_engine_stats
from shoal.outputs import RequestOutput
from shoal.pooling_params import PoolingParams
from shoal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the server answers 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class RequestStream:
    """Async iterator over one request's outputs. `abort()` is safe to call at any time.

    Outputs wait in a plain deque; the consumer is woken once however many arrive before it
    runs, and `drain()` takes them all at once (a stream writes them in one go)."""

    def __init__(self, engine: AsyncLLM, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.constrained = False  # its output follows a grammar (structured outputs)

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and not self._items:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._take(self._items.popleft())

    async def drain(self) -> list[RequestOutput]:
        """Every output that has arrived (waiting for at least one); [] when finished."""
        if self.finished and not self._items:
            return []
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items, self._items = self._items, deque()
        out: list[RequestOutput] = []
        while items and not self.finished:
            item = items[0]
            failing = isinstance(item, BaseException) or (item.finished and item.error)
            if failing and out:  # hand over the outputs first, raise on the next call
                self._items = items
                return out
            out.append(self._take(items.popleft()))
        return out

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error:
                raise request_error(item.error_code, item.error)
        return item

    async def wait_first(self) -> None:
        """Waits for the first output without taking it; raises if the request failed before
        producing anything (a stream answers such a request with an error status, not 200)."""
        while not self._items and not self.finished:
            self._ready.clear()
            await self._ready.wait()
        if self._items:
            item = self._items[0]
            if isinstance(item, BaseException) or (item.finished and item.error):
                self._take(self._items.popleft())

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, client: EngineCoreClient, ready: Ready,
                 tokenizer: Any, *, log_stats_interval: float = 10.0):
        self.engine_args = engine_args
        self.client = client
        self.ready = ready
        self.tokenizer = tokenizer
        self.limits = ready.limits
        self.max_model_len = ready.limits.max_model_len
        self.vocab_size = ready.limits.vocab_size
        self.inputs = InputProcessor(tokenizer, ready.limits,
                                     max_logprobs=engine_args.max_logprobs,
                                     mm=MultiModalFrontend.build(
                                         engine_args.model, tokenizer,
                                         ready.limits.mm_max_embeds, engine_args))
        self.outputs = OutputProcessor(tokenizer)
        self.max_waiting_requests = engine_args.max_waiting_requests
        self.stat_loggers: list[StatLogger] = []
        self.last_stats = SchedulerStats()  # the whole server's (replicas merged)
        self._engine_stats: dict[int, SchedulerStats] = {}
        self.errored: BaseException | None = None
        self._dead_callbacks: list[Any] = []
        self._log_interval = log_stats_interval
        client.on_dead(self._on_engine_dead)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._output_handler(), name="output-handler"),
                       loop.create_task(self._log_loop(), name="stats-log")]

    @classmethod
    async def from_engine_args(cls, engine_args: EngineArgs, *, log_level: int = logging.INFO,
                               startup_timeout: float | None = None,
                               log_stats_interval: float = 10.0,
                               build_core: Any = None, client: Any = None) -> AsyncLLM:
        """`client`: an engine client started already (start_engine_client), which this
        engine then owns; by default one is started here."""
        from shoal.loader import load_frontend_tokenizer

        if client is None:
            client = await start_engine_client(engine_args, log_level=log_level,
                                               build_core=build_core)
        try:
            # Read while the engine process loads the model.
            tokenizer = None if engine_args.skip_tokenizer_init else await asyncio.to_thread(
                load_frontend_tokenizer, engine_args.model, engine_args.tokenizer)
            ready = await client.wait_ready(startup_timeout)
            return cls(engine_args, client, ready, tokenizer,
                       log_stats_interval=log_stats_interval)
        except BaseException:
            await client.shutdown()
            raise

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    output_kind: OutputKind = OutputKind.FINAL_ONLY,
                    lora_request: LoRARequest | None = None,
                    data_parallel_rank: int | None = None) -> RequestStream:
        """Validates and submits; raises ValueError (bad input), QueueFullError or
        EngineDeadError before anything reaches the core. data_parallel_rank: the replica
        to run on (data_parallel_size > 1; None: the least loaded)."""
        if self.errored is not None:
            raise EngineDeadError(str(self.errored))
        rank = check_data_parallel_rank(data_parallel_rank,
                                        self.engine_args.data_parallel_size)
        req = self.inputs.process_request(request_id, prompt, params, priority=priority,
                                          cache_salt=cache_salt, lora_request=lora_request)
        for r in req.core_requests:  # every sample of it on that replica
            r.data_parallel_rank = rank
        self._check_queue(len(req.core_requests))
        stream = RequestStream(self, request_id)
        stream.constrained = params.structured_outputs is not None
        self.outputs.add_request(req, output_kind, stream.put)
        for r in req.core_requests:
            self.client.add_request(r)
        return stream

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            *, priority: int = 0, token_type_ids: list[int] | None = None
                            ) -> RequestStream:
        """A pooling request (embed, classify, score); its one output is a
        PoolingRequestOutput. Raises like add_request."""
        if self.errored is not None:
            raise EngineDeadError(str(self.errored))
        req = self.inputs.process_pooling_request(request_id, prompt, params, priority=priority,
                                                  token_type_ids=token_type_ids)
        self._check_queue(1)
        stream = RequestStream(self, request_id)
        self.outputs.add_request(req, OutputKind.FINAL_ONLY, stream.put)
        self.client.add_request(req.core_requests[0])
        return stream

    def _check_queue(self, n: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        max_seqs = self.client.max_num_seqs  # the live replicas' (data parallelism)
        if n > max_seqs + limit:  # could never be admitted: retrying will not help
            raise ValueError(f"n ({n}) is larger than this server can ever hold "
                             f"(max_num_seqs + max_waiting_requests = {max_seqs + limit})")
        # Sequences beyond the batch-size limit wait; the last stats also count those kept
        # waiting by a full KV pool.
        waiting = max(self.outputs.num_live_samples + n - max_seqs,
                      self.last_stats.num_waiting + n if self.last_stats.num_waiting else 0)
        if waiting > limit:
            raise QueueFullError(
                f"the server is busy: {waiting} sequences would be waiting "
                f"(max_waiting_requests={limit}); retry later")

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0, *, cache_salt: str | None = None,
                       output_kind: OutputKind = OutputKind.FINAL_ONLY,
                       lora_request: LoRARequest | None = None,
                       data_parallel_rank: int | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; stopping early (or cancellation) aborts it."""
        stream = self.add_request(request_id, prompt, sampling_params, priority=priority,
                                  cache_salt=cache_salt, output_kind=output_kind,
                                  lora_request=lora_request,
                                  data_parallel_rank=data_parallel_rank)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stops a request in the engine (its KV blocks are freed at once) and forgets it."""
        it = IterationStats()
        live = self.outputs.abort(request_id, it)
        self._ended(it, engine=self.client.engine_of(live[0]) if live else 0)
        if live and not self.client.dead:
            self.client.abort_requests(live)

    def abort_all(self, error: BaseException) -> None:
        """Ends every request in flight with `error` (each consumer gets it, so a server
        answers it properly) and stops them in the engine; the engine keeps running."""
        live: list[str] = []
        for rid in self.outputs.request_ids():
            it = IterationStats()
            ids = self.outputs.fail(rid, error, it)
            self._ended(it, engine=self.client.engine_of(ids[0]) if ids else 0)
            live += ids
        if live and not self.client.dead:
            self.client.abort_requests(live)

    @property
    def num_unfinished_requests(self) -> int:
        return self.outputs.num_unfinished

    @property
    def is_healthy(self) -> bool:
        return self.errored is None and self.client.is_alive

    def on_dead(self, callback: Any) -> None:
        self._dead_callbacks.append(callback)

    async def reset_stats(self) -> None:
        await self.client.call_utility("reset_stats")

    async def sleep(self, level: int = 1) -> None:
        """The engine frees its KV cache and weights (shoal/worker/lifecycle.py); requests
        are refused until wake_up."""
        await self.client.call_utility("sleep", timeout=120.0, args=[level])
        self._set_sleep_metric(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.client.call_utility("wake_up", timeout=300.0, args=[tags])
        self._set_sleep_metric(0 if not await self.is_sleeping() else -1)

    async def is_sleeping(self) -> bool:
        return bool(await self.client.call_utility("is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    async def pause_generation(self, *, wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True) -> None:
        """vLLM's: no new request is admitted until resume_generation (they wait queued);
        the live ones are aborted (finish_reason "abort"), or with wait_for_inflight_requests
        run to their end, which this waits for; clear_cache then resets the prefix cache."""
        await self.client.call_utility("pause_generation",
                                       args=[wait_for_inflight_requests, clear_cache])
        while not await self.client.call_utility("pause_settled"):
            await asyncio.sleep(0.01)  # the engine's loop steps the drain meanwhile

    async def resume_generation(self) -> None:
        await self.client.call_utility("resume_generation")

    async def is_paused(self) -> bool:
        return bool(await self.client.call_utility("is_paused"))

    async def collective_rpc(self, method: str, args: list[Any] | None = None,
                             kwargs: dict[str, Any] | None = None,
                             timeout: float = 600.0) -> list[Any]:
        """A lifecycle method (shoal/worker/lifecycle.py RPC_METHODS) on every rank: their
        results. Weight updates need an idle or paused engine and empty the prefix cache."""
        results = await self.client.call_utility("collective_rpc", timeout=timeout,
                                                 args=[method, list(args or ()), kwargs or {}])
        if method == "sleep":  # (the gauge follows, as with sleep and wake_up)
            self._set_sleep_metric(int([*(args or ()), (kwargs or {}).get("level", 1)][0]))
        elif method == "wake_up":
            self._set_sleep_metric(0 if not await self.is_sleeping() else -1)
        return results

    async def update_weights_from_path(self, path: str, timeout: float = 600.0) -> int:
        """A checkpoint folder (or .gguf) of this model: the number of tensors loaded."""
        return (await self.collective_rpc("update_weights_from_path", [str(path)],
                                          timeout=timeout))[0]

    def _set_sleep_metric(self, level: int) -> None:
        if level < 0:  # partly awake: leave the gauge as it was
            return
        for logger in self.stat_loggers:
            setter = getattr(logger, "set_sleep_level", None)
            if setter is not None:
                setter(level)

    # ---- LoRA adapters (vLLM's; shoal/engine/core_lora.py says what each does) ----------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter in the engine ahead of its requests; ValueError naming it."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"add_lora takes a LoRARequest (got "
                             f"{type(lora_request).__name__})")
        return bool(await self._lora_call("add_lora", lora_request, timeout=120.0))

    async def remove_lora(self, lora_id: int) -> bool:
        """An unloaded adapter leaves the engine's host memory and slots; False when it was
        not loaded or requests still run or wait with it."""
        return bool(await self._lora_call("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        return set(await self._lora_call("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        return bool(await self._lora_call("pin_lora", lora_id))

    async def _lora_call(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        """The engine's ValueError (it crosses the socket as "ValueError: ...") raised as one."""
        try:
            return await self.client.call_utility(method, timeout=timeout, args=list(args))
        except RuntimeError as e:
            kind, _, message = str(e).partition(": ")
            if kind == "ValueError" and type(e) is RuntimeError:
                raise ValueError(message) from None
            raise

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
        it = IterationStats()
        for cid, rejection in msg.rejected.items():
            self._fail_parent(cid, request_error(rejection.code, rejection.message), it)
        for cid, reason in msg.lost.items():  # a data-parallel replica died under it
            self._fail_parent(cid, request_error(ErrorCode.REPLICA_LOST, reason), it)
        _, to_abort = self.outputs.process_outputs(msg.outputs.outputs, it)
        if to_abort:
            self.client.abort_requests(to_abort)
        stats = msg.outputs.stats
        if stats is not None:
            self._engine_stats[msg.engine_index] = stats
            self.last_stats = merge_engine_stats(list(self._engine_stats.values()), stats)
        self._ended(it, stats, msg.engine_index, always=True)

    def _fail_parent(self, child_id: str, error: BaseException, it: IterationStats) -> None:
        """Ends the request a core request belongs to; its siblings are aborted in the core."""
        rid = self.outputs.parent_of(child_id)
        if rid is not None:
            self.client.abort_requests(self.outputs.fail(rid, error, it))

    def _ended(self, it: IterationStats, stats: SchedulerStats | None = None, engine: int = 0,
               always: bool = False) -> None:
        """Hands the iteration (finished requests, latencies) to the stat loggers."""
        if always or it.finished:
            for sl in self.stat_loggers:
                sl.record(stats, it, engine)

    def _fail_all(self, err: BaseException) -> None:
        self.errored = err
        self.outputs.fail_all(err)

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
