"""/v1/chat/completions (and its /batch form): chat template -> engine requests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.beam_search import check_beam_search
from shoal.engine.async_llm import RequestStream
from shoal.engine.input_processor import ProcessedPrompt
from shoal.engine.output_processor import OutputKind
from shoal.entrypoints.openai.beam_search_runner import BeamSearchRunner
from shoal.entrypoints.openai.chat_stream_shaper import ChoiceShaper
from shoal.entrypoints.openai.errors import OpenAIError, error_body, error_from_exception
from shoal.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_entries
from shoal.entrypoints.openai.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    check_context_length,
)
from shoal.entrypoints.openai.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
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
from shoal.entrypoints.openai.tool_choice import ToolPlan
from shoal.multimodal.chat_parts import content_text
from shoal.outputs import CompletionOutput, RequestOutput
from shoal.prompt_truncation import GENERATION_SIDE, truncate_prompt
from shoal.structured_output.parsers import get_reasoning_parser
from shoal.structured_output.reasoning_parsers import ReasoningParser


def _tool_calls_for_template(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as a mapping
    (vLLM parses the JSON text the same way)."""
    if not isinstance(calls, list):
        raise OpenAIError(400, "tool_calls must be a list", f"messages[{i}].tool_calls")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(400, "each tool call needs a function with a name",
                              f"messages[{i}].tool_calls")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise OpenAIError(400, "tool call arguments must be JSON text",
                                  f"messages[{i}].tool_calls") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def messages_to_dicts(messages: list[ChatMessage], placeholder: str | None = None,
                      images: list[Any] | None = None) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; text parts are joined. Image parts become the
    model's placeholder text, their URLs appended to `images` (given when the model takes
    images); other parts are refused. Tool results (role "tool") and assistant tool calls
    pass to the template."""
    out = []
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        content = m.content
        if isinstance(content, list):
            where = f"messages[{i}].content"
            try:
                content = content_text(content, placeholder if images is not None else None,
                                       images if images is not None else [], where)
            except ValueError as e:
                raise OpenAIError(400, str(e), where) from None
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if extra.get("tool_calls"):
            d["tool_calls"] = _tool_calls_for_template(i, extra["tool_calls"])
        if isinstance(extra.get("tool_call_id"), str):
            d["tool_call_id"] = extra["tool_call_id"]
        out.append(d)
    return out


class OpenAIServingChat(ServingBase):
    @property
    def reasoning(self) -> ReasoningParser | None:
        name = self.settings.reasoning_parser
        return get_reasoning_parser(name) if name else None

    def _format_in_special_tokens(self, plan: ToolPlan | None) -> bool:
        """The reasoning or tool call parser reads special tokens (gpt-oss's harmony)."""
        parsers = [self.reasoning, plan.parser if plan is not None else None]
        return any(getattr(p, "keeps_special_tokens", False) for p in parsers)

    def render(self, req: ChatCompletionRequest,
               messages: list[ChatMessage] | None = None) -> ProcessedPrompt:
        prompt, media = self._render_text(req, messages)
        return self._with_media(prompt, media) if media else prompt

    async def render_async(self, req: ChatCompletionRequest,
                           messages: list[ChatMessage] | None = None) -> ProcessedPrompt:
        """render, with the media fetched, decoded and processed on the media threads: never
        on the event loop, where they would stall every other request's stream."""
        prompt, media = self._render_text(req, messages)
        if media:
            prompt = await self.engine.inputs.mm.offload(self._with_media, prompt, media)
        return prompt

    def _with_media(self, prompt: ProcessedPrompt, media: list[Any]) -> ProcessedPrompt:
        return self.engine.inputs.with_images(prompt, {"image": self.engine.inputs.mm.load(media)})

    def _render_text(self, req: ChatCompletionRequest, messages: list[ChatMessage] | None
                     ) -> tuple[ProcessedPrompt, list[Any] | None]:
        """The templated prompt and its media sources (fetched and decoded once the request
        is known to be good otherwise)."""
        mm = self.engine.inputs.mm
        images: list[Any] | None = [] if mm is not None else None
        try:
            prompt = self.engine.inputs.process_chat(
                messages_to_dicts(req.messages if messages is None else messages,
                                  mm.image_placeholder if mm is not None else None, images),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens,
                chat_template=req.chat_template, chat_template_kwargs=req.template_kwargs())
        except (jinja2.TemplateError, TypeError) as e:  # a bad template or kwargs is user input
            raise ValueError(f"the chat template failed: {e}") from e
        if req.truncate_prompt_tokens is not None:
            side = req.truncation_side or GENERATION_SIDE  # (vLLM's generation tokenizers')
            ids = truncate_prompt(prompt.prompt_token_ids, req.truncate_prompt_tokens, side,
                                  self.engine.max_model_len - 1)
            prompt = ProcessedPrompt(prompt.prompt if ids == prompt.prompt_token_ids else None,
                                     ids)
        return prompt, images

    def _prepare(self, req: ChatCompletionRequest) -> tuple[int | None, int | None]:
        """Checks the request; returns (top logprobs k, max_tokens)."""
        if (bad := req.unsupported()) is not None:
            raise OpenAIError(400, bad[1], bad[0])
        if req.stream and req.prompt_logprobs is not None:
            raise OpenAIError(400, "prompt_logprobs are not available when stream is true",
                              "prompt_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        return k, max_tokens

    def _plan(self, req: ChatCompletionRequest) -> ToolPlan:
        return self.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                              "response_format or structured_outputs"
                              if req.constraint() is not None else None)

    def _submit(self, req: ChatCompletionRequest, prompt: ProcessedPrompt, k: int | None,
                max_tokens: int | None, engine_id: str, plan: ToolPlan | None = None,
                replica: int | None = None) -> RequestStream:
        check_context_length(len(prompt.prompt_token_ids), max_tokens, self.engine.max_model_len,
                             "max_completion_tokens" if req.max_completion_tokens is not None
                             else "max_tokens")
        constraint = plan.constraint if plan is not None and plan.constraint else req.constraint()
        params = req.to_sampling_params(max_tokens, k, req.prompt_logprobs, constraint,
                                        self.sampling_defaults)
        if self._format_in_special_tokens(plan):
            params.skip_special_tokens = False  # the parsers read the markers (harmony)
        return self.engine.add_request(
            engine_id, prompt, params, priority=req.priority, cache_salt=req.cache_salt,
            output_kind=OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY,
            lora_request=self.models.lora(req.model), data_parallel_rank=replica)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.models.check(req.model)
        k, max_tokens = self._prepare(req)
        plan = self._plan(req)
        prompt = await self.render_async(req)
        if req.use_beam_search:
            if plan.constraint is not None or req.constraint() is not None:
                raise OpenAIError(400, "use_beam_search cannot be combined with structured "
                                       "outputs or a required/named tool_choice",
                                  "use_beam_search")
            return await self._beam_search(req, raw, model, prompt, k, max_tokens)
        stream = self._submit(req, prompt, k, max_tokens, random_id("chatcmpl"), plan,
                              self.replica(raw))
        rid = response_id("chatcmpl", req.request_id, raw)
        if req.stream:
            if stream.constrained:
                await wait_grammar_checked([stream])
            return StreamingResponse(self._stream(req, model, rid, stream, k, plan),
                                     media_type="text/event-stream")
        try:
            final = await cancel_on_disconnect(raw, self._last(stream))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            stream.abort()
        return JSONResponse(self._response(req, model, rid, final, k, plan=plan).model_dump(),
                            headers=self.load_headers(raw))

    async def _beam_search(self, req: ChatCompletionRequest, raw: Request, model: str,
                           prompt: ProcessedPrompt, k: int | None, max_tokens: int | None
                           ) -> Response:
        """use_beam_search: n is the beam width; one choice per beam, best first."""
        field = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        check_context_length(len(prompt.prompt_token_ids), max_tokens, self.engine.max_model_len,
                             field)
        if max_tokens is None:  # as a sampled request: up to the context length
            max_tokens = self.engine.max_model_len - len(prompt.prompt_token_ids)
        params = req.to_beam_search_params(max_tokens)
        check_beam_search(params, len(prompt.prompt_token_ids), self.engine.max_model_len,
                          self.engine.inputs.max_logprobs, self.engine.limits.request.max_n,
                          width_field="n")
        run = BeamSearchRunner(self.engine, random_id("chatcmpl"), params,
                               priority=req.priority, cache_salt=req.cache_salt,
                               lora_request=self.models.lora(req.model))
        try:
            (final,) = await cancel_on_disconnect(raw, run.run([prompt]))
        except ClientDisconnected:
            return Response(status_code=499)
        rid = response_id("chatcmpl", req.request_id, raw)
        return JSONResponse(self._response(req, model, rid, final, k).model_dump(),
                            headers=self.load_headers(raw))

    async def create_batch(self, req: BatchChatCompletionRequest, raw: Request) -> Response:
        """N conversations in one request, one choice each (indexed 0..N-1), as vLLM's
        /v1/chat/completions/batch."""
        model = self.models.check(req.model)
        k, max_tokens = self._prepare(req)
        prompts = [await self.render_async(req, conversation) for conversation in req.messages]
        engine_id, replica = random_id("chatcmpl"), self.replica(raw)
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                streams.append(self._submit(req, p, k, max_tokens, f"{engine_id}-{i}",
                                            replica=replica))
            finals: list[RequestOutput | None] = [None] * len(streams)

            async def collect() -> None:
                async for i, out in merge_streams(streams):
                    finals[i] = out

            await cancel_on_disconnect(raw, collect())
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            for s in streams:
                s.abort()
        rid = response_id("chatcmpl", req.request_id, raw)
        parts = [self._response(req, model, rid, out, k, conversation)
                 for out, conversation in zip(finals, req.messages) if out is not None]
        choices = [c.model_copy(update={"index": i}) for i, p in enumerate(parts)
                   for c in p.choices]
        usage = Usage.of(sum(p.usage.prompt_tokens for p in parts),
                         sum(p.usage.completion_tokens for p in parts),
                         self.cached(sum(out.num_cached_tokens for out in finals if out)))
        body = ChatCompletionResponse(id=rid, created=now_s(), model=model, choices=choices,
                                      usage=usage)
        return JSONResponse(body.model_dump(), headers=self.load_headers(raw))

    @staticmethod
    async def _last(stream: RequestStream) -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        assert last is not None  # a finished stream always ends with an output
        return last

    def _logprobs(self, req: ChatCompletionRequest, c: CompletionOutput,
                  k: int | None) -> ChatLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        if k == -1:
            k = self.engine.vocab_size
        if req.logprob_token_ids:
            k = None  # each position holds the sampled token and the asked ids: all of them
        decode = self.token_decoder(req.return_tokens_as_token_ids)
        return ChatLogprobs(content=chat_logprobs(c.token_ids, c.logprobs, k, decode,
                                                  self.token_bytes()))

    @staticmethod
    def _role_and_echo(req: ChatCompletionRequest,
                       messages: list[ChatMessage] | None = None) -> tuple[str, str]:
        """The role of the answer (the last message's when it is continued) and, for `echo`,
        the text that answer continues."""
        last = (req.messages if messages is None else messages)[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        echo = ""
        if req.echo and last.role == role:
            echo = messages_to_dicts([last])[0]["content"]
        return role, echo

    def _message(self, role: str, text: str, plan: ToolPlan | None, finish: str | None
                 ) -> tuple[ChatResponseMessage, str | None]:
        """The answer's message (reasoning split off, tool calls parsed) and finish reason."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            text = text or ""
        if plan is None or plan.mode == "none":
            return ChatResponseMessage(role=role, content=text,
                                       reasoning_content=reasoning), finish
        content, calls = plan.calls_from_text(text)
        if plan.mode in ("named", "required") and calls:
            content = content or ""
        if calls and finish == "stop" and plan.mode in ("auto", "required"):
            finish = "tool_calls"
        return ChatResponseMessage(role=role, content=content, reasoning_content=reasoning,
                                   tool_calls=[c.as_dict() for c in calls]), finish

    def _response(self, req: ChatCompletionRequest, model: str, rid: str, out: RequestOutput,
                  k: int | None, messages: list[ChatMessage] | None = None,
                  plan: ToolPlan | None = None) -> ChatCompletionResponse:
        role, echo = self._role_and_echo(req, messages)
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            message, finish = self._message(role, echo + c.text, plan, c.finish_reason)
            choices.append(ChatChoice(
                index=c.index, message=message, logprobs=self._logprobs(req, c, k),
                finish_reason=finish, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None))
        completion = sum(len(c.token_ids) for c in out.outputs)
        prompt_lps = None
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_entries(out.prompt_logprobs, self._decode)
        return ChatCompletionResponse(
            id=rid, created=now_s(), model=model, choices=choices,
            usage=Usage.of(len(out.prompt_token_ids), completion,
                           self.cached(out.num_cached_tokens)),
            prompt_logprobs=prompt_lps,
            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
            kv_transfer_params=out.kv_transfer_params)

    def _stream_choice(self, req: ChatCompletionRequest, c: CompletionOutput,
                       k: int | None, shaper: ChoiceShaper | None = None
                       ) -> dict[str, Any] | None:
        """One streamed choice as the pydantic ChatStreamChoice dumps it (built as a dict: this
        runs once per token). A shaper turns the text into reasoning / tool-call deltas."""
        lps = self._logprobs(req, c, k) if c.token_ids else None
        finish = c.finish_reason
        if shaper is None:
            delta: dict[str, Any] = {"content": c.text}
            has_delta = bool(c.text)
        else:
            delta = shaper.feed(c.text, finish is not None)
            finish = shaper.finish_reason(finish)
            has_delta = bool(delta)
        if not has_delta and finish is None and lps is None and not req.return_token_ids:
            return None
        choice = {"index": c.index, "delta": delta,
                  "logprobs": lps.model_dump() if lps is not None else None,
                  "finish_reason": finish, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    async def _stream(self, req: ChatCompletionRequest, model: str, rid: str,
                      stream: RequestStream, k: int | None, plan: ToolPlan | None = None
                      ) -> AsyncIterator[str]:
        created = now_s()
        n = 1 if req.n is None else req.n
        shapers: dict[int, ChoiceShaper] = {}
        if (plan is not None and plan.mode != "none") or self.reasoning is not None:
            shapers = {i: ChoiceShaper(plan or ToolPlan("none"), self.reasoning)
                       for i in range(n)}
        final_usage, continuous = req.stream_usage(self.settings.enable_force_include_usage)
        role, echo = self._role_and_echo(req)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model}
        prompt_tokens = cached = completion = 0
        finished: set[int] = set()

        def chunk(choices: list[dict[str, Any]], first: bool = False) -> str:
            body: dict[str, Any] = {**head, "choices": choices, "system_fingerprint": None,
                                    "service_tier": None}
            if first and req.return_token_ids:
                body["prompt_token_ids"] = prompt_ids
            if continuous:
                body["usage"] = Usage.dict_of(prompt_tokens, completion, self.cached(cached))
            return sse(body)

        prompt_ids: list[int] | None = None
        try:
            batches = output_batches([stream])
            pending: list[Any] = []
            if req.return_token_ids or continuous:  # these need the prompt in the first chunk
                pending = await anext(batches, [])
                if pending:
                    out = pending[0][1]
                    prompt_ids = list(out.prompt_token_ids)
                    prompt_tokens, cached = len(prompt_ids), out.num_cached_tokens
            # OpenAI opens every choice with the role and empty content.
            opening = [chunk([{"index": i, "delta": {"role": role, "content": ""},
                               "logprobs": None, "finish_reason": None}], first=i == 0)
                       for i in range(n)]
            if echo:
                opening += [chunk([{"index": i, "delta": {"content": echo}, "logprobs": None,
                                    "finish_reason": None}]) for i in range(n)]
            yield "".join(opening)

            async def all_batches() -> AsyncIterator[Any]:
                if pending:
                    yield pending
                async for b in batches:
                    yield b

            async for batch in all_batches():
                events = []
                for _, out in batch:
                    prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                    for c in out.outputs:
                        completion += len(c.token_ids)
                        if c.finish_reason is not None:
                            finished.add(c.index)
                        choice = self._stream_choice(req, c, k, shapers.get(c.index))
                        if choice is not None:  # e.g. half a UTF-8 character, held back
                            events.append(chunk([choice]))
                if events:
                    yield "".join(events)
            if final_usage:
                body = {**head, "choices": [], "system_fingerprint": None, "service_tier": None,
                        "usage": Usage.dict_of(prompt_tokens, completion, self.cached(cached))}
                yield sse(body)
        except Exception as e:  # headers are gone: report in-band
            err = error_from_exception(e)
            ends = abort_choices(range(n), finished, lambda i: {
                **head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                     "finish_reason": "abort"}]})
            yield "".join(ends) + sse(error_body(err.status, err.message, err.param))
        finally:
            stream.abort()
        yield DONE
