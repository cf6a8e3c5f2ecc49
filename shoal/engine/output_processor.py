"""Engine-core outputs in, RequestOutputs out (frontend side): detokenization, stop strings,
logprobs, fan-in of the n samples of one prompt, and the per-request latency statistics.

The OutputProcessor owns every live request's frontend state, including, for the server, the
queue its RequestOutputs are delivered to. A request without a queue (the offline engine)
gets its RequestOutputs returned from `process_outputs` instead.

A request that only wants the final text and has no stop strings is detokenized once, when it
finishes, instead of token by token: the same text (decoding is incremental only to find stop
strings and to stream), at a fraction of the frontend's cost per token."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.core.errors import ErrorCode
from shoal.core.types import EngineCoreOutput, Logprobs
from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.engine.input_processor import ProcessedRequest
from shoal.metrics.stats import FinishedParentStats, FinishedRequestStats, IterationStats
from shoal.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every update carries the whole text so far
    DELTA = 1  # every update carries only what is new (streaming)
    FINAL_ONLY = 2  # one update, when the request finishes


# Where a request's RequestOutputs (or the exception that ends it) are delivered.
Deliver = Callable[[RequestOutput | BaseException], Any]


@dataclass
class _Sample:
    index: int
    child_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    detok_at_end: bool  # decode once when finished (final-only output, no stop strings)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_sent: bool = False
    first_token: float | None = None  # time.monotonic() of its first / last token
    last_token: float | None = None
    queue_time: float | None = None  # arrival -> first scheduled, from the engine


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    samples: list[_Sample]
    metrics: RequestMetrics
    arrival: float  # time.monotonic(), for the latency statistics
    deliver: Deliver | None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: ErrorCode | None = None
    is_pooling: bool = False
    pooled: Any = None  # a pooling request's result (numpy float32 array)
    kv_transfer_params: dict[str, Any] | None = None  # a producer's (disaggregated prefill)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._by_child: dict[str, tuple[_Request, _Sample]] = {}
        self._token_text: dict[int, str] = {}
        self.num_live_samples = 0  # samples not finished yet, over every request

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(self, req: ProcessedRequest, kind: OutputKind = OutputKind.FINAL_ONLY,
                    deliver: Deliver | None = None) -> None:
        """Registers a validated request; `deliver` receives its outputs (else they are
        returned by process_outputs)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        params = req.params
        samples = [self._new_sample(i, creq.request_id, params, req.prompt_token_ids, kind)
                   for i, creq in enumerate(req.core_requests)]
        r = _Request(req.request_id, req.prompt, req.prompt_token_ids, kind, samples,
                     RequestMetrics(time.time()), req.core_requests[0].arrival_time, deliver,
                     prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                     is_pooling=req.core_requests[0].pooling_params is not None)
        self._requests[req.request_id] = r
        self.num_live_samples += len(samples)
        for s in samples:
            self._by_child[s.child_id] = (r, s)

    def _new_sample(self, index: int, child_id: str, params: SamplingParams,
                    prompt_token_ids: list[int], kind: OutputKind) -> _Sample:
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop or [],
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
        with_lp = params.num_logprobs is not None
        return _Sample(index, child_id, params, detok,
                       detok_at_end=detok is not None and kind == OutputKind.FINAL_ONLY
                       and not detok.stop,
                       logprobs=[] if with_lp else None,
                       cumulative_logprob=0.0 if with_lp else None)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def parent_of(self, child_id: str) -> str | None:
        entry = self._by_child.get(child_id)
        return entry[0].request_id if entry is not None else None

    def abort(self, request_id: str, it: IterationStats | None = None,
              reason: str = "abort") -> list[str]:
        """Forgets a request; returns the child ids the core must still abort."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return []
        live = [s.child_id for s in r.samples if s.finish_reason is None]
        self.num_live_samples -= len(live)
        for s in r.samples:
            self._by_child.pop(s.child_id, None)
        if it is not None:
            now = time.monotonic()
            for s in r.samples:
                if s.finish_reason is None:  # the others were counted when they ended
                    it.finished.append(self._sample_stats(r, s, reason, now))
            it.finished_parents.append(self._parent_stats(r))
        return live

    def fail(self, request_id: str, error: BaseException, it: IterationStats | None = None
             ) -> list[str]:
        """Ends a request with an exception delivered to its consumer."""
        r = self._requests.get(request_id)
        live = self.abort(request_id, it, reason="error")
        if r is not None and r.deliver is not None:
            r.deliver(error)
        return live

    def fail_all(self, error: BaseException, it: IterationStats | None = None) -> list[str]:
        """Ends every request with `error`; returns the child ids the core must abort."""
        live: list[str] = []
        for rid in list(self._requests):
            live += self.fail(rid, error, it)
        return live

    # ---- outputs ----------------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput], it: IterationStats | None = None,
                        now: float | None = None) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's outputs. Delivers (or, for requests without a consumer, returns)
        the RequestOutputs due, and returns the child ids the core must abort (they hit a stop
        string). Latencies are added to `it` when given."""
        now = time.monotonic() if now is None else now
        touched: dict[str, _Request] = {}
        to_abort: list[str] = []
        for o in outputs:
            entry = self._by_child.get(o.request_id)
            if entry is None:
                continue  # aborted by the frontend already
            r, s = entry
            if s.finish_reason is not None:
                continue
            touched[r.request_id] = r
            if self._apply(r, s, o, now, it):
                to_abort.append(o.request_id)
            if s.finish_reason is not None:
                self._by_child.pop(o.request_id, None)
                self.num_live_samples -= 1
                if it is not None:
                    # (its own reason: a sibling's error is not this sample's)
                    it.finished.append(self._sample_stats(r, s, s.finish_reason, now))
        returned = []
        for r in touched.values():
            out = self._due_output(r, now, it)
            if out is None:
                continue
            if r.deliver is not None:
                r.deliver(out)
            else:
                returned.append(out)
        return returned, to_abort

    def _apply(self, r: _Request, s: _Sample, o: EngineCoreOutput, now: float,
               it: IterationStats | None) -> bool:
        """One sample's output; True when a stop string ended it (the core must abort it)."""
        r.num_cached_tokens = o.num_cached_tokens
        if o.kv_transfer_params is not None:
            r.kv_transfer_params = o.kv_transfer_params
        if o.prompt_logprobs and r.prompt_logprobs is not None and s.index == 0:
            for pos, lp in o.prompt_logprobs:
                while len(r.prompt_logprobs) <= pos:
                    r.prompt_logprobs.append(None)
                r.prompt_logprobs[pos] = self._position_logprobs(lp)
        if o.pooled is not None:
            r.pooled = np.frombuffer(o.pooled, dtype=np.float32).reshape(o.pooled_shape)
            if it is not None:
                it.num_prompt_tokens += len(r.prompt_token_ids)
        if o.new_token_ids:
            if it is not None:
                it.num_generation_tokens += len(o.new_token_ids)
                if s.first_token is None:  # the sample's prompt is done
                    it.num_prompt_tokens += len(r.prompt_token_ids)
                    it.num_cached_prompt_tokens += o.num_cached_tokens
            self._time_tokens(r, s, now, it, o.queue_time)
            s.token_ids.extend(o.new_token_ids)
        if o.new_logprobs and s.logprobs is not None:
            for lp in o.new_logprobs:
                s.logprobs.append(self._position_logprobs(lp))
                s.cumulative_logprob += lp.logprobs[0]
        stop_str = None
        # the core stopped on a token (EOS, stop_token_ids): its text is left out (vLLM)
        token_stop = o.stop_token
        if s.detok is not None and not s.detok_at_end:
            stop_str = s.detok.update(o.new_token_ids, token_stop)
        if stop_str is not None:
            s.finish_reason, s.stop_reason = "stop", stop_str
            return True
        if o.finish_reason is not None:
            s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
            if o.error:
                r.error, r.error_code = o.error, o.error_code
            if s.detok_at_end:
                s.detok.update(s.token_ids, token_stop)
        return False

    @staticmethod
    def _time_tokens(r: _Request, s: _Sample, now: float, it: IterationStats | None,
                     queue_time: float | None) -> None:
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = time.time()
        if it is not None:
            if s.first_token is None:
                it.time_to_first_tokens.append(now - r.arrival)
            elif s.last_token is not None:
                it.inter_token_latencies.append(now - s.last_token)
            if queue_time is not None:
                it.queue_times.append(queue_time)
        if queue_time is not None and s.queue_time is None:
            s.queue_time = queue_time
        if s.first_token is None:
            s.first_token = now
        s.last_token = now

    def _due_output(self, r: _Request, now: float, it: IterationStats | None
                    ) -> RequestOutput | None:
        done = r.finished
        if done:
            r.metrics.finished_time = time.time()
            self._requests.pop(r.request_id, None)
            if it is not None:
                it.finished_parents.append(self._parent_stats(r))
        if r.kind == OutputKind.FINAL_ONLY and not done:
            return None
        return self._make_output(r, done)

    @staticmethod
    def _sample_stats(r: _Request, s: _Sample, reason: str, now: float
                      ) -> FinishedRequestStats:
        """One ended sample's latencies by phase (vLLM's queued / prefill / decode /
        inference); phases it never reached count 0."""
        n_tokens = len(s.token_ids)
        f = FinishedRequestStats(reason, now - r.arrival, len(r.prompt_token_ids), n_tokens,
                                 max_tokens=s.params.max_tokens,
                                 num_cached_tokens=r.num_cached_tokens)
        if s.queue_time is not None:
            f.queued_time = s.queue_time
            scheduled = r.arrival + s.queue_time
            if s.first_token is not None:
                f.prefill_time = max(s.first_token - scheduled, 0.0)
                f.decode_time = s.last_token - s.first_token
                f.inference_time = max(s.last_token - scheduled, 0.0)
                if n_tokens > 1:
                    f.mean_time_per_output_token = f.decode_time / (n_tokens - 1)
        return f

    @staticmethod
    def _parent_stats(r: _Request) -> FinishedParentStats:
        return FinishedParentStats(len(r.samples), max(len(s.token_ids) for s in r.samples))

    def _position_logprobs(self, lp: Logprobs) -> PositionLogprobs:
        out: PositionLogprobs = {}
        for j, (tid, val) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tid in out:
                continue
            rank = lp.rank if j == 0 else j
            out[tid] = Logprob(val, rank, self._decode_token(tid))
        return out

    def _decode_token(self, tid: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(tid)
        if text is None:
            text = self.tokenizer.decode([tid])
            self._token_text[tid] = text
        return text

    def _make_output(self, r: _Request, finished: bool) -> RequestOutput | PoolingRequestOutput:
        if r.is_pooling:
            return PoolingRequestOutput(
                request_id=r.request_id,
                outputs=PoolingOutput(r.pooled) if r.pooled is not None else None,
                prompt_token_ids=r.prompt_token_ids, finished=finished,
                num_cached_tokens=r.num_cached_tokens, error=r.error, prompt=r.prompt,
                error_code=r.error_code)
        outs = [c for c in (self._completion(s, r.kind == OutputKind.DELTA) for s in r.samples)
                if c is not None]
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids, prompt_logprobs=r.prompt_logprobs,
            outputs=outs, finished=finished, num_cached_tokens=r.num_cached_tokens,
            metrics=r.metrics, error=r.error, error_code=r.error_code,
            kv_transfer_params=r.kv_transfer_params,
        )

    @staticmethod
    def _completion(s: _Sample, delta: bool) -> CompletionOutput | None:
        sample_done = s.finish_reason is not None
        if delta:
            if s.finish_sent:
                return None
            text = s.detok.get_delta(sample_done) if s.detok else ""
            ids = s.token_ids[s.sent_tokens:]
            lps = s.logprobs[s.sent_logprobs:] if s.logprobs is not None else None
            s.sent_tokens, s.sent_logprobs = len(s.token_ids), len(s.logprobs or [])
            s.finish_sent = sample_done
            if not text and not ids and not sample_done:
                return None
        else:
            text = s.detok.output_text if s.detok else ""
            ids, lps = list(s.token_ids), s.logprobs
        return CompletionOutput(index=s.index, text=text, token_ids=ids,
                                cumulative_logprob=s.cumulative_logprob, logprobs=lps,
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason)
