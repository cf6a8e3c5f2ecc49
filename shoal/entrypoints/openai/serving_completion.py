"""/v1/completions: one engine request per prompt, choices numbered prompt * n + sample."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.engine.async_llm import AsyncLLM, RequestStream
from shoal.engine.output_processor import OutputKind
from shoal.entrypoints.openai.errors import OpenAIError, error_body, error_from_exception
from shoal.entrypoints.openai.logprobs import clamp, completion_logprobs, decode_token
from shoal.entrypoints.openai.protocol import CompletionRequest, check_context_length
from shoal.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionResponse,
    Usage,
    now_s,
    random_id,
)
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.streaming import (
    DONE,
    ClientDisconnected,
    cancel_on_disconnect,
    merge_streams,
    output_batches,
    sse,
)
from shoal.outputs import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> a non-empty list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or "
                         "a list of token-id lists, and must not be empty")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for p in prompt:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ValueError("prompt token-id lists must contain only integers")
        return [list(p) for p in prompt]
    raise ValueError("prompt must not mix strings, token ids and lists")


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, models: ServedModels):
        self.engine = engine
        self.models = models

    def _decode(self, token_id: int) -> str:
        return decode_token(self.engine.tokenizer, token_id)

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.engine.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.models.check(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, bad[1], bad[0])
        prompts = [self.engine.inputs.process(p) for p in normalize_prompts(req.prompt)]
        for p in prompts:
            check_context_length(len(p.prompt_token_ids), req.max_tokens,
                                 self.engine.max_model_len)
        k = req.logprobs
        prompt_k = req.prompt_logprobs
        if req.echo and k is not None:
            prompt_k = max(k, prompt_k or 0)
        params = req.to_sampling_params(
            DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens, k, prompt_k)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        request_id = random_id("cmpl")
        streams: list[RequestStream] = []
        try:  # validate and submit every prompt, or none
            for i, p in enumerate(prompts):
                streams.append(self.engine.add_request(
                    f"{request_id}-{i}", p, params, priority=req.priority,
                    cache_salt=req.cache_salt, output_kind=kind))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        if req.stream:
            return StreamingResponse(self._stream(req, model, request_id, streams),
                                     media_type="text/event-stream")
        try:
            finals = await cancel_on_disconnect(raw, self._collect(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            for s in streams:
                s.abort()
        return JSONResponse(self._response(req, model, request_id, finals).model_dump())

    @staticmethod
    async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return [f for f in finals if f is not None]

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput, ids: list[int],
                         positions: list[Any], echo_text: str | None):
        k = req.logprobs
        if k is None:
            return None
        if echo_text is not None and out.prompt_logprobs is not None:
            ids = list(out.prompt_token_ids) + ids
            positions = list(out.prompt_logprobs) + positions
        return completion_logprobs(ids, positions, k, self._decode)

    def _response(self, req: CompletionRequest, model: str, request_id: str,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for pi, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            echo = self._prompt_text(out) if req.echo else None
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(CompletionChoice(
                    index=pi * len(out.outputs) + c.index,
                    text=(echo or "") + c.text,
                    logprobs=self._choice_logprobs(req, out, list(c.token_ids),
                                                   list(c.logprobs or []), echo),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(req, out),
                ))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, created=now_s(), model=model, choices=choices,
                                  usage=Usage.of(prompt_tokens, completion_tokens, cached))

    def _prompt_logprobs(self, req: CompletionRequest,
                         out: RequestOutput) -> list[dict[str, float] | None] | None:
        if req.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return [None if pos is None else
                {(lp.decoded_token or self._decode(t)): clamp(lp.logprob) for t, lp in pos.items()}
                for pos in out.prompt_logprobs]

    async def _stream(self, req: CompletionRequest, model: str, request_id: str,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created = now_s()
        n = 1 if req.n is None else req.n
        offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        prompt_tokens = [0] * len(streams)
        cached = [0] * len(streams)
        completion_tokens = 0
        # One dict per chunk, encoded by msgspec: the same JSON the pydantic model gives
        # (CompletionResponse without usage), at a fraction of the cost per streamed token.
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": model}
        try:
            async for batch in output_batches(streams):
                events = []
                for pi, out in batch:
                    prompt_tokens[pi] = len(out.prompt_token_ids)
                    cached[pi] = out.num_cached_tokens
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        choice = self._stream_choice(req, out, c, pi * n + c.index, offsets)
                        events.append(sse({**head, "choices": [choice],
                                           "system_fingerprint": None}))
                yield "".join(events)
            if req.include_usage:
                usage = Usage.of(sum(prompt_tokens), completion_tokens, sum(cached))
                yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                             choices=[], usage=usage))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            err = error_from_exception(e)
            yield sse(error_body(err.status, err.message, err.param))
        finally:
            for s in streams:
                with contextlib.suppress(Exception):
                    s.abort()
        yield DONE

    def _stream_choice(self, req: CompletionRequest, out: RequestOutput, c: Any, index: int,
                       offsets: dict[int, int]) -> dict[str, Any]:
        first = index not in offsets
        echo = self._prompt_text(out) if req.echo and first else None
        text = (echo or "") + c.text
        lps = self._choice_logprobs(req, out, list(c.token_ids), list(c.logprobs or []), echo)
        if lps is not None and lps.text_offset:
            base = offsets.get(index, 0)
            lps.text_offset = [o + base for o in lps.text_offset]
        offsets[index] = offsets.get(index, 0) + len(text)
        return {"index": index, "text": text,
                "logprobs": lps.model_dump() if lps is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "prompt_logprobs": None}
