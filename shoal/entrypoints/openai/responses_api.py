"""/v1/responses: OpenAI's Responses API for text in and text out, with function calling
(responses_tools.py).

The input (a string or a list of messages, after `instructions` and the conversation of
`previous_response_id`) goes through the chat template like a chat completion. Stored
responses are kept by response_store.py, at most --max-stored-responses of them (the oldest are
dropped; one store for all API processes of --api-server-count N), so `previous_response_id`
can continue a conversation and GET /v1/responses/{id} can fetch one.
Streams send the Responses event sequence (response.created ... response.completed)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr

from shoal.engine.async_llm import RequestStream
from shoal.engine.generation_defaults import capped_max_tokens
from shoal.engine.output_processor import OutputKind
from shoal.entrypoints.openai.constraints import response_format_params
from shoal.entrypoints.openai.errors import OpenAIError, error_from_exception
from shoal.entrypoints.openai.pool_state import member
from shoal.entrypoints.openai.protocol import Number, OpenAIBaseModel, check_context_length
from shoal.entrypoints.openai.response_store import ResponseStore, SharedResponseStore
from shoal.entrypoints.openai.responses import now_s, random_id
from shoal.entrypoints.openai.responses_tools import (
    assistant_turn,
    chat_tool_choice,
    chat_tools,
    function_call_item,
    input_item_messages,
)
from shoal.entrypoints.openai.serving_common import ServingBase
from shoal.entrypoints.openai.streaming import (
    ClientDisconnected,
    cancel_on_disconnect,
    sse,
    wait_grammar_checked,
)
from shoal.entrypoints.openai.tool_choice import ToolPlan
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams
from shoal.structured_output.params import StructuredOutputsParams

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    store: StrictBool = True
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: StrictBool = True
    reasoning: dict[str, Any] | None = None
    truncation: StrictStr | None = "disabled"
    include: list[Any] | None = None
    background: StrictBool = False
    top_logprobs: StrictInt | None = None

    def field_name(self, param: str | None) -> str | None:
        """The request's own name for a field an engine error names: its prompt is `input`,
        its token limit max_output_tokens."""
        return {"prompt": "input", "max_tokens": "max_output_tokens"}.get(param, param)

    def constraint(self) -> StructuredOutputsParams | None:
        """text.format as a constraint (the Responses API's spelling of response_format)."""
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type") == "json_schema":
            return response_format_params({"type": "json_schema", "json_schema": {
                "schema": fmt.get("schema")}})
        return response_format_params(fmt) if fmt.get("type") == "json_object" else None

    def unsupported(self) -> tuple[str, str] | None:
        bad = self.not_implemented()
        if bad is not None:
            return bad
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
            return "text", "text.format must be text, json_object or json_schema"
        checks = [("reasoning", bool(self.reasoning), "reasoning options are not supported"),
                  ("truncation", self.truncation not in (None, "disabled"),
                   "only truncation 'disabled' is supported"),
                  ("include", bool(self.include), "include is not supported"),
                  ("background", self.background, "background responses are not supported"),
                  ("top_logprobs", bool(self.top_logprobs), "top_logprobs is not supported "
                                                            "yet in the Responses API")]
        for name, bad_value, message in checks:
            if bad_value:
                return name, message
        return None


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (text parts, function calls and their
    results)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages = []
    for i, item in enumerate(req.input):
        if item.get("type") in ("function_call", "function_call_output"):
            messages.append(input_item_messages(item, f"input[{i}]"))
            continue
        if item.get("type", "message") != "message" or "role" not in item:
            raise OpenAIError(400, f"input items of type {item.get('type')!r} are not "
                                   "supported; only messages, function_call and "
                                   "function_call_output", f"input[{i}]")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(400, f"content parts of type {kind!r} are not supported; "
                                           "only text", f"input[{i}].content")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise OpenAIError(400, "a message's content must be a string or text parts",
                              f"input[{i}].content")
        messages.append({"role": str(item["role"]), "content": content})
    return messages


def open_response_store(capacity: int) -> ResponseStore | SharedResponseStore:
    """This process's own store, or in a pool (--api-server-count) the one all share."""
    pool = member()
    if pool is None or capacity <= 0:
        return ResponseStore(capacity)
    return SharedResponseStore(pool.shared.file, capacity)


class OpenAIServingResponses(ServingBase):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self.store = open_response_store(self.settings.max_stored_responses)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id)[0]

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        model = self.models.check(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, bad[1], bad[0])
        tools = chat_tools(req.tools)
        plan = self._plan(req, tools)
        history = self.store.get(req.previous_response_id, "previous_response_id")[1] \
            if req.previous_response_id else []
        turn = input_messages(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            prompt = self.engine.inputs.process_chat(
                system + history + turn, chat_template_kwargs={"tools": tools} if tools else None)
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"the chat template failed: {e}") from e
        check_context_length(len(prompt.prompt_token_ids), req.max_output_tokens,
                             self.engine.max_model_len, "max_output_tokens")
        d = self.sampling_defaults  # the model's generation config
        max_tokens = capped_max_tokens(req.max_output_tokens, d)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self._sampling(req, "temperature"), top_p=self._sampling(req, "top_p"),
            top_k=d.get("top_k", 0), min_p=d.get("min_p", 0.0),
            repetition_penalty=d.get("repetition_penalty", 1.0),
            structured_outputs=plan.constraint or req.constraint())
        stream = self.engine.add_request(
            random_id("resp"), prompt, params,
            output_kind=OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY,
            lora_request=self.models.lora(req.model), data_parallel_rank=self.replica(raw))
        rid, msg_id = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        conversation = history + turn
        if req.stream:
            if stream.constrained:  # a grammar that fails is a 400, not an in-band error
                await wait_grammar_checked([stream])
            return StreamingResponse(
                self._stream(req, model, rid, msg_id, stream, conversation, plan),
                media_type="text/event-stream")
        try:
            outs = await cancel_on_disconnect(raw, _all(stream))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            stream.abort()
        final = outs[-1]
        content, items = _output(plan, final.outputs[0].text)
        body = self._response(req, model, rid, msg_id, content, final, "completed", items)
        await self._keep(req, body, conversation, content, items)
        return JSONResponse(body, headers=self.load_headers(raw))

    def _plan(self, req: ResponsesRequest, tools: list[dict[str, Any]]) -> ToolPlan:
        """The chat path's tool plan for the request (no tools: plain text, whatever
        tool_choice says, as its default is "auto")."""
        if not tools:
            return ToolPlan("none")
        return self.tool_plan(tools, chat_tool_choice(req.tool_choice), req.parallel_tool_calls,
                              "text.format" if req.constraint() is not None else None)

    async def _keep(self, req: ResponsesRequest, body: dict[str, Any],
                    conversation: list[dict[str, Any]], text: str,
                    items: list[dict[str, Any]] = ()) -> None:
        if req.store:
            await self.store.put(body, conversation + [assistant_turn(text, list(items))])

    def _sampling(self, req: ResponsesRequest, name: str) -> float:
        """temperature or top_p: the request's, else the generation config's, else 1.0."""
        value = getattr(req, name)
        return self.sampling_defaults.get(name, 1.0) if value is None else value

    def _response(self, req: ResponsesRequest, model: str, rid: str, msg_id: str, text: str,
                  out: RequestOutput | None, status: str,
                  calls: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """The Response object; `status` "in_progress" while streaming, else decided by how
        the generation finished. `calls`: its function_call items (after the message, which
        is left out when the answer is only calls)."""
        finish = out.outputs[0].finish_reason if out is not None and out.outputs else None
        incomplete = None
        if status != "in_progress":
            status = "incomplete" if finish == "length" else "completed"
            if finish == "length":
                incomplete = {"reason": "max_output_tokens"}
        output = [] if status == "in_progress" else (
            ([_message(msg_id, text, "completed")] if text or not calls else []) + list(calls))
        usage = None
        if out is not None and status != "in_progress":
            n_in = len(out.prompt_token_ids)
            n_out = sum(len(c.token_ids) for c in out.outputs)
            usage = {"input_tokens": n_in,
                     "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": n_in + n_out}
        return {
            "id": rid, "object": "response", "created_at": now_s(), "status": status,
            "model": model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            # what ran: the request's, else the model's generation config, else 1.0
            "temperature": self._sampling(req, "temperature"),
            "top_p": self._sampling(req, "top_p"),
            "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice,
            "tools": req.tools or [], "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": req.metadata or {}, "store": req.store, "user": req.user,
            "reasoning": None,
        }

    async def _stream(self, req: ResponsesRequest, model: str, rid: str, msg_id: str,
                      stream: RequestStream, conversation: list[dict[str, Any]],
                      plan: ToolPlan) -> AsyncIterator[str]:
        """Plain text streams as it comes; an answer that may hold function calls is sent
        once complete (its message, then each call's item and argument events)."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\n" + sse({"type": kind, "sequence_number": seq - 1,
                                             **fields})

        def message_opens() -> str:
            return (event("response.output_item.added", output_index=0,
                          item=_message(msg_id, "", "in_progress"))
                    + event("response.content_part.added", **at, part=_part("")))

        def message_closes(text: str) -> str:
            return (event("response.output_text.done", **at, text=text, logprobs=[])
                    + event("response.content_part.done", **at, part=_part(text))
                    + event("response.output_item.done", output_index=0,
                            item=_message(msg_id, text, "completed")))

        plain = plan.mode == "none"
        at = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        text_parts: list[str] = []
        last: RequestOutput | None = None
        pending = self._response(req, model, rid, msg_id, "", None, "in_progress")
        yield (event("response.created", response=pending)
               + event("response.in_progress", response=pending)
               + (message_opens() if plain else ""))
        try:
            while True:
                outs = await stream.drain()
                if not outs:
                    break
                last = outs[-1]
                deltas = [c.text for o in outs for c in o.outputs if c.text]
                text_parts += deltas
                if deltas and plain:
                    yield "".join(event("response.output_text.delta", **at, delta=d,
                                        logprobs=[]) for d in deltas)
        except Exception as e:  # headers are gone: the Responses API reports in-band
            err = error_from_exception(e)
            yield event("error", code=str(err.status), message=err.message, param=err.param)
            failed = {**pending, "status": "failed",
                      "error": {"code": "server_error", "message": err.message}}
            yield event("response.failed", response=failed)
            return
        finally:
            stream.abort()
        content, items = _output(plan, "".join(text_parts))
        body = self._response(req, model, rid, msg_id, content, last, "completed", items)
        await self._keep(req, body, conversation, content, items)
        events = []
        if plain:
            events.append(message_closes(content))
        elif content or not items:
            events += [message_opens(), event("response.output_text.delta", **at,
                                              delta=content, logprobs=[]),
                       message_closes(content)]
        first = 1 if plain or content or not items else 0  # a message item comes first
        for j, item in enumerate(items):
            where = {"item_id": item["id"], "output_index": first + j}
            events += [event("response.output_item.added", output_index=first + j,
                             item={**item, "arguments": "", "status": "in_progress"}),
                       event("response.function_call_arguments.delta", **where,
                             delta=item["arguments"]),
                       event("response.function_call_arguments.done", **where,
                             arguments=item["arguments"]),
                       event("response.output_item.done", output_index=first + j, item=item)]
        yield "".join(events) + event(f"response.{body['status']}", response=body)


def _output(plan: ToolPlan, text: str) -> tuple[str, list[dict[str, Any]]]:
    """(the answer's text beside its calls, the calls' function_call items)."""
    content, calls = plan.calls_from_text(text)
    return content or "", [function_call_item(c) for c in calls]


async def _all(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [_part(text)] if status == "completed" else []}
