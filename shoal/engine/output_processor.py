"""Engine-core outputs in, RequestOutputs out: detokenization, stop strings, logprobs, and
fan-in of the n samples of one prompt (frontend side)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from shoal.engine.core_types import EngineCoreOutput, Logprobs
from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from shoal.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every update carries the whole text so far
    DELTA = 1  # every update carries only what is new (streaming)
    FINAL_ONLY = 2  # one update, when the request finishes


@dataclass
class _Sample:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_sent: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Sample]] = {}
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, kind: OutputKind = OutputKind.FINAL_ONLY,
                    arrival_time: float | None = None) -> list[tuple[str, SamplingParams]]:
        """Registers a prompt; returns the (child id, params) pairs to send to the engine core."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples, children = [], []
        for i in range(params.n):
            child_params = params.for_sample(i) if params.n > 1 else params
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop or [],
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            s = _Sample(i, params, detok,
                        logprobs=[] if params.logprobs is not None else None,
                        cumulative_logprob=0.0 if params.logprobs is not None else None)
            samples.append(s)
            children.append((child_request_id(request_id, i, params.n), child_params))
        parent = _Parent(request_id, prompt, prompt_token_ids, kind, samples,
                         RequestMetrics(arrival_time or time.time()),
                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self._parents[request_id] = parent
        for (cid, _), s in zip(children, samples):
            self._child_to_parent[cid] = (parent, s)
        return children

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def child_ids(self, request_id: str) -> list[str]:
        p = self._parents.get(request_id)
        if p is None:
            return []
        n = len(p.samples)
        return [child_request_id(request_id, s.index, n) for s in p.samples if s.finish_reason is None]

    def abort(self, request_id: str) -> None:
        p = self._parents.pop(request_id, None)
        if p is not None:
            for s in p.samples:
                self._child_to_parent.pop(child_request_id(request_id, s.index, len(p.samples)), None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to deliver and the child ids the core must abort (they hit
        a stop string)."""
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        now = time.time()
        for o in outputs:
            entry = self._child_to_parent.get(o.request_id)
            if entry is None:
                continue  # aborted by the frontend already
            parent, s = entry
            if s.finish_reason is not None:
                continue
            touched[parent.request_id] = parent
            parent.num_cached_tokens = o.num_cached_tokens
            if o.prompt_logprobs and parent.prompt_logprobs is not None and s.index == 0:
                for pos, lp in o.prompt_logprobs:
                    while len(parent.prompt_logprobs) <= pos:
                        parent.prompt_logprobs.append(None)
                    parent.prompt_logprobs[pos] = self._position_logprobs(lp)
            if o.new_token_ids and parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            s.token_ids.extend(o.new_token_ids)
            if o.new_logprobs and s.logprobs is not None:
                for lp in o.new_logprobs:
                    s.logprobs.append(self._position_logprobs(lp))
                    s.cumulative_logprob += lp.logprobs[0]
            stop_str = s.detok.update(o.new_token_ids) if s.detok is not None else None
            if stop_str is not None:
                s.finish_reason, s.stop_reason = "stop", stop_str
                to_abort.append(o.request_id)
            elif o.finish_reason is not None:
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
                if o.error:
                    parent.error = o.error
            if s.finish_reason is not None:
                self._child_to_parent.pop(o.request_id, None)
        results = []
        for parent in touched.values():
            done = parent.finished
            if done:
                parent.metrics.finished_time = now
                self._parents.pop(parent.request_id, None)
            if parent.kind == OutputKind.FINAL_ONLY and not done:
                continue
            results.append(self._make_output(parent, done))
        return results, to_abort

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

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        delta = parent.kind == OutputKind.DELTA
        outs = []
        for s in parent.samples:
            sample_done = s.finish_reason is not None
            if delta:
                if s.finish_sent:
                    continue
                text = s.detok.get_delta(sample_done) if s.detok else ""
                ids = s.token_ids[s.sent_tokens:]
                lps = s.logprobs[s.sent_logprobs:] if s.logprobs is not None else None
                s.sent_tokens, s.sent_logprobs = len(s.token_ids), len(s.logprobs or [])
                s.finish_sent = sample_done
                if not text and not ids and not sample_done:
                    continue
            else:
                text = s.detok.output_text if s.detok else ""
                ids, lps = list(s.token_ids), s.logprobs
            outs.append(CompletionOutput(
                index=s.index, text=text, token_ids=ids,
                cumulative_logprob=s.cumulative_logprob, logprobs=lps,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            ))
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=parent.prompt_logprobs,
            outputs=outs, finished=finished, num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics, error=parent.error,
        )
