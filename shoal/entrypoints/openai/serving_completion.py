"""/v1/completions: one engine request per prompt, choices numbered prompt * n + sample.

`echo` with `max_tokens` 0 scores a prompt (what lm-eval's loglikelihood asks for): the engine
runs one step (the prompt's logprobs come from that step's forward pass) and the choice
carries the prompt alone, its text, ids and logprobs; the sampled token is dropped."""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.beam_search import check_beam_search
from shoal.engine.async_llm import RequestStream
from shoal.engine.input_processor import ProcessedPrompt
from shoal.engine.output_processor import OutputKind
from shoal.entrypoints.openai.beam_search_runner import BeamSearchRunner
from shoal.entrypoints.openai.errors import OpenAIError, error_body, error_from_exception
from shoal.entrypoints.openai.logprobs import (
    completion_logprobs,
    prompt_logprobs_entries,
    utf8_counter,
)
from shoal.entrypoints.openai.protocol import (
    CompletionRequest,
    RequestFieldError,
    check_context_length,
)
from shoal.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionResponse,
    Usage,
    now_s,
    random_id,
)
from shoal.entrypoints.openai.serving_common import ServingBase, response_id
from shoal.entrypoints.openai.streaming import (
    DONE,
    ClientDisconnected,
    abort_choices,
    cancel_on_disconnect,
    merge_streams,
    output_batches,
    sse,
    wait_grammar_checked,
)
from shoal.outputs import RequestOutput
from shoal.prompt_truncation import GENERATION_SIDE, truncate_prompt

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> a non-empty list of prompts."""
    if prompt is None or (isinstance(prompt, (str, list)) and not prompt):
        # vLLM's wording (its prompt_embeds alternative is refused by shoal with its own 400)
        raise RequestFieldError("Either prompt or prompt_embeds must be provided and "
                                "non-empty.", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or "
                         "a list of token-id lists, and must not be empty")
    # set(map(type, ...)) runs at C speed: this is on every request's path, over every token
    # of a token-id prompt (bools are not ints here: type(True) is bool).
    kinds = set(map(type, prompt))
    if kinds == {int}:
        return [list(prompt)]
    if kinds == {str}:
        return list(prompt)
    if kinds == {list}:
        for p in prompt:
            if set(map(type, p)) - {int}:
                raise ValueError("prompt token-id lists must contain only integers")
        return [list(p) for p in prompt]
    raise ValueError("prompt must not mix strings, token ids and lists")


class OpenAIServingCompletion(ServingBase):
    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.engine.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _process(self, prompt: str | list[int], req: CompletionRequest,
                 max_tokens: int) -> ProcessedPrompt:
        inputs = self.engine.inputs
        k = req.truncate_prompt_tokens
        if k is None:
            return inputs.process(prompt, add_special_tokens=req.add_special_tokens)
        max_input = self.engine.max_model_len - max_tokens
        if k > max_input:
            raise ValueError(f"truncate_prompt_tokens ({k}) must not be greater than "
                             f"max_model_len - max_tokens = {max_input}")
        text = prompt if isinstance(prompt, str) else None
        ids = prompt if text is None else inputs.process(
            text, add_special_tokens=req.add_special_tokens).prompt_token_ids
        side = req.truncation_side or GENERATION_SIDE  # (vLLM's generation tokenizers')
        kept = truncate_prompt(list(ids), k, side, max_input)
        return inputs.process({"prompt_token_ids": kept,
                               "prompt": text if len(kept) == len(ids) else None})

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.models.check(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, bad[1], bad[0])
        if req.stream and req.prompt_logprobs is not None:
            raise OpenAIError(400, "prompt_logprobs are not available when stream is true",
                              "prompt_logprobs")
        if req.stop and self.engine.tokenizer is None:
            raise OpenAIError(400, "stop strings need the tokenizer, and this server runs "
                                   "without one (--skip-tokenizer-init)", "stop")
        scoring = req.echo and req.max_tokens == 0
        max_tokens = 1 if scoring else (DEFAULT_MAX_TOKENS if req.max_tokens is None
                                        else req.max_tokens)
        raw_prompts = normalize_prompts(req.prompt)
        self.engine.inputs.check_num_prompts(len(raw_prompts))
        prompts = [self._process(p, req, max_tokens) for p in raw_prompts]
        for p in prompts:
            check_context_length(len(p.prompt_token_ids), max_tokens, self.engine.max_model_len)
        k = req.logprobs
        prompt_k = req.prompt_logprobs
        if req.echo and k is not None:
            prompt_k = -1 if -1 in (k, prompt_k) else max(k, prompt_k or 0)
        if req.use_beam_search:
            if req.constraint() is not None:
                raise OpenAIError(400, "use_beam_search cannot be combined with structured "
                                       "outputs (response_format, structured_outputs, "
                                       "guided_*)", "use_beam_search")
            return await self._beam_search(req, raw, model, prompts, max_tokens)
        params = req.to_sampling_params(max_tokens, k, prompt_k, req.constraint(),
                                        self.sampling_defaults)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        engine_id = random_id("cmpl")
        replica = self.replica(raw)
        streams: list[RequestStream] = []
        try:  # validate and submit every prompt, or none
            for i, p in enumerate(prompts):
                streams.append(self.engine.add_request(
                    f"{engine_id}-{i}", p, params, priority=req.priority,
                    cache_salt=req.cache_salt, output_kind=kind,
                    lora_request=self.models.lora(req.model), data_parallel_rank=replica))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        rid = response_id("cmpl", req.request_id, raw)
        if req.stream:
            if params.structured_outputs is not None:
                await wait_grammar_checked(streams)
            return StreamingResponse(self._stream(req, model, rid, streams),
                                     media_type="text/event-stream")
        try:
            finals = await cancel_on_disconnect(raw, self._collect(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            for s in streams:
                s.abort()
        return JSONResponse(self._response(req, model, rid, finals).model_dump(),
                            headers=self.load_headers(raw))

    async def _beam_search(self, req: CompletionRequest, raw: Request, model: str,
                           prompts: list[ProcessedPrompt], max_tokens: int) -> Response:
        """use_beam_search: n is the beam width; one choice per beam, best first."""
        params = req.to_beam_search_params(max_tokens)
        for p in prompts:
            check_beam_search(params, len(p.prompt_token_ids), self.engine.max_model_len,
                              self.engine.inputs.max_logprobs,
                              self.engine.limits.request.max_n, width_field="n")
        run = BeamSearchRunner(self.engine, random_id("cmpl"), params, priority=req.priority,
                               cache_salt=req.cache_salt,
                               lora_request=self.models.lora(req.model))
        try:
            finals = await cancel_on_disconnect(raw, run.run(prompts))
        except ClientDisconnected:
            return Response(status_code=499)
        rid = response_id("cmpl", req.request_id, raw)
        return JSONResponse(self._response(req, model, rid, finals).model_dump(),
                            headers=self.load_headers(raw))

    @staticmethod
    async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return [f for f in finals if f is not None]

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput, ids: list[int],
                         positions: list[Any], echo: bool,
                         chars: codecs.IncrementalDecoder | None = None):
        k = req.logprobs
        if k is None:
            return None
        if echo and out.prompt_logprobs is not None:
            ids = list(out.prompt_token_ids) + ids
            positions = list(out.prompt_logprobs) + positions
        if k == -1:
            k = self.engine.vocab_size
        if req.logprob_token_ids:
            k = None  # generated positions hold the sampled token and the asked ids: all
        return completion_logprobs(ids, positions, k,
                                   self.token_decoder(req.return_tokens_as_token_ids),
                                   token_bytes=self.token_bytes(), chars=chars)

    def _response(self, req: CompletionRequest, model: str, rid: str,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        scoring = req.echo and req.max_tokens == 0
        n = 1 if req.n is None else req.n
        prompt_tokens = completion_tokens = cached = 0
        for pi, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            echo = self._prompt_text(out) if req.echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)  # as vLLM, also the scoring step's token
                ids, lps = ([], []) if scoring else (list(c.token_ids), list(c.logprobs or []))
                choices.append(CompletionChoice(
                    index=pi * n + c.index,
                    text=echo + ("" if scoring else c.text),
                    logprobs=self._choice_logprobs(req, out, ids, lps, req.echo),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(req, out),
                    prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids
                    else None,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                ))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=rid, created=now_s(), model=model, choices=choices,
                                  usage=Usage.of(prompt_tokens, completion_tokens,
                                                 self.cached(cached)),
                                  kv_transfer_params=finals[0].kv_transfer_params
                                  if len(finals) == 1 else None)

    def _prompt_logprobs(self, req: CompletionRequest,
                         out: RequestOutput) -> list[dict[str, Any] | None] | None:
        if req.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return prompt_logprobs_entries(out.prompt_logprobs, self._decode)

    async def _stream(self, req: CompletionRequest, model: str, rid: str,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created = now_s()
        n = 1 if req.n is None else req.n
        final_usage, continuous = req.stream_usage(self.settings.enable_force_include_usage)
        offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        # choice index -> its tokens' UTF-8 decoder (text_offset across chunks)
        decoders: dict[int, codecs.IncrementalDecoder] = {}
        sent: dict[int, int] = {}  # choice index -> tokens sent (continuous usage)
        finished: set[int] = set()
        prompt_tokens = [0] * len(streams)
        cached = [0] * len(streams)
        completion_tokens = 0
        # One dict per chunk, encoded by msgspec: the same JSON the pydantic model gives
        # (CompletionResponse without usage), at a fraction of the cost per streamed token.
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        try:
            async for batch in output_batches(streams):
                events = []
                for pi, out in batch:
                    prompt_tokens[pi] = len(out.prompt_token_ids)
                    cached[pi] = out.num_cached_tokens
                    for c in out.outputs:
                        index = pi * n + c.index
                        completion_tokens += len(c.token_ids)
                        choice = self._stream_choice(req, out, c, index, offsets, decoders)
                        if c.finish_reason is not None:
                            finished.add(index)
                        chunk = {**head, "choices": [choice], "system_fingerprint": None}
                        if continuous:
                            sent[index] = sent.get(index, 0) + len(c.token_ids)
                            chunk["usage"] = Usage.dict_of(prompt_tokens[pi], sent[index],
                                                           self.cached(cached[pi]))
                        events.append(sse(chunk))
                yield "".join(events)
            if final_usage:
                usage = Usage.of(sum(prompt_tokens), completion_tokens,
                                 self.cached(sum(cached)))
                yield sse(CompletionResponse(id=rid, created=created, model=model,
                                             choices=[], usage=usage))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            err = error_from_exception(e)
            ends = abort_choices(range(len(streams) * n), finished,
                                 lambda i: {**head, "choices": [
                                     {"index": i, "text": "", "logprobs": None,
                                      "finish_reason": "abort", "stop_reason": None}]})
            yield "".join(ends) + sse(error_body(err.status, err.message, err.param))
        finally:
            for s in streams:
                with contextlib.suppress(Exception):
                    s.abort()
        yield DONE

    def _stream_choice(self, req: CompletionRequest, out: RequestOutput, c: Any, index: int,
                       offsets: dict[int, int],
                       decoders: dict[int, codecs.IncrementalDecoder]) -> dict[str, Any]:
        first = index not in offsets
        echo = req.echo and first
        scoring = req.echo and req.max_tokens == 0
        ids, lps = ([], []) if scoring else (list(c.token_ids), list(c.logprobs or []))
        text = (self._prompt_text(out) if echo else "") + ("" if scoring else c.text)
        lp = self._choice_logprobs(req, out, ids, lps, echo,
                                   decoders.setdefault(index, utf8_counter()))
        if lp is not None and lp.text_offset:
            base = offsets.get(index, 0)
            lp.text_offset = [o + base for o in lp.text_offset]
        offsets[index] = offsets.get(index, 0) + len(text)
        choice = {"index": index, "text": text,
                  "logprobs": lp.model_dump() if lp is not None else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                  "prompt_logprobs": None}
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(out.prompt_token_ids) if first else None
            choice["token_ids"] = list(c.token_ids)
        return choice
