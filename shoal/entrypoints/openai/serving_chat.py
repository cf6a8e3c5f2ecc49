"""/v1/chat/completions: chat template -> one engine request with n samples."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.engine.async_llm import AsyncLLM, RequestStream
from shoal.engine.input_processor import ProcessedPrompt
from shoal.engine.output_processor import OutputKind
from shoal.entrypoints.openai.errors import OpenAIError, error_body, error_from_exception
from shoal.entrypoints.openai.logprobs import chat_logprobs, decode_token
from shoal.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    check_context_length,
)
from shoal.entrypoints.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
    now_s,
    random_id,
)
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.streaming import (
    DONE,
    ClientDisconnected,
    cancel_on_disconnect,
    output_batches,
    sse,
)
from shoal.outputs import CompletionOutput, RequestOutput


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; text parts are joined, other parts refused."""
    out = []
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        if extra.get("tool_calls") or m.role in ("tool", "function"):
            raise OpenAIError(400, "tool calling is not supported yet (tool messages)",
                              f"messages[{i}]")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind != "text":
                    raise OpenAIError(400, f"content parts of type {kind!r} are not supported "
                                           "yet; only 'text'", f"messages[{i}].content")
                if not isinstance(part.get("text"), str):
                    raise OpenAIError(400, "a text content part needs a string 'text'",
                                      f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


class OpenAIServingChat:
    def __init__(self, engine: AsyncLLM, models: ServedModels):
        self.engine = engine
        self.models = models

    def _decode(self, token_id: int) -> str:
        return decode_token(self.engine.tokenizer, token_id)

    def render(self, req: ChatCompletionRequest) -> ProcessedPrompt:
        try:
            return self.engine.inputs.process_chat(
                messages_to_dicts(req.messages), add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
        except (jinja2.TemplateError, TypeError) as e:  # a bad template or kwargs is user input
            raise ValueError(f"the chat template failed: {e}") from e

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.models.check(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, bad[1], bad[0])
        prompt = self.render(req)
        k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        check_context_length(len(prompt.prompt_token_ids), max_tokens, self.engine.max_model_len,
                             "max_completion_tokens" if req.max_completion_tokens is not None
                             else "max_tokens")
        params = req.to_sampling_params(max_tokens, k, req.prompt_logprobs)
        request_id = random_id("chatcmpl")
        stream = self.engine.add_request(
            request_id, prompt, params, priority=req.priority, cache_salt=req.cache_salt,
            output_kind=OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY)
        if req.stream:
            return StreamingResponse(self._stream(req, model, request_id, stream, k),
                                     media_type="text/event-stream")
        try:
            final = await cancel_on_disconnect(raw, self._last(stream))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            stream.abort()
        return JSONResponse(self._response(model, request_id, final, k).model_dump())

    @staticmethod
    async def _last(stream: RequestStream) -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        assert last is not None  # a finished stream always ends with an output
        return last

    def _logprobs(self, c: CompletionOutput, k: int | None) -> ChatLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(c.token_ids, c.logprobs, k, self._decode))

    def _response(self, model: str, request_id: str, out: RequestOutput,
                  k: int | None) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(c, k), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason)
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        completion = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=request_id, created=now_s(), model=model, choices=choices,
            usage=Usage.of(len(out.prompt_token_ids), completion, out.num_cached_tokens))

    def _stream_choice(self, c: CompletionOutput, k: int | None) -> dict[str, Any] | None:
        """One streamed choice as the pydantic ChatStreamChoice dumps it (built as a dict: this
        runs once per token)."""
        lps = self._logprobs(c, k) if c.token_ids else None
        if not c.text and c.finish_reason is None and lps is None:
            return None
        return {"index": c.index, "delta": {"content": c.text},
                "logprobs": lps.model_dump() if lps is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def _stream(self, req: ChatCompletionRequest, model: str, request_id: str,
                      stream: RequestStream, k: int | None) -> AsyncIterator[str]:
        created = now_s()
        n = 1 if req.n is None else req.n

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=choices, usage=usage)
            return sse(body.model_dump(exclude=None if usage else {"usage"}))

        prompt_tokens = cached = completion = 0
        try:
            # OpenAI opens every choice with the role and empty content.
            for i in range(n):
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                          content=""))])
            head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model}
            async for batch in output_batches([stream]):
                events = []
                for _, out in batch:
                    prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                    for c in out.outputs:
                        completion += len(c.token_ids)
                        choice = self._stream_choice(c, k)
                        if choice is not None:  # e.g. half a UTF-8 character, held back
                            events.append(sse({**head, "choices": [choice],
                                               "system_fingerprint": None}))
                if events:
                    yield "".join(events)
            if req.include_usage:
                yield chunk([], Usage.of(prompt_tokens, completion, cached))
        except Exception as e:  # headers are gone: report in-band
            err = error_from_exception(e)
            yield sse(error_body(err.status, err.message, err.param))
        finally:
            stream.abort()
        yield DONE
