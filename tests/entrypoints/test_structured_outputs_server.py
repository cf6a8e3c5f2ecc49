"""Structured outputs and tool calling through `shoal serve` with the official openai client,
on the real SmolLM2: every constrained answer holds, streams end as the full answers do, and
bad constraints are 400s that say why. (benchmarks/structured_outputs_cpu.py runs the issue's
50 JSON-schema requests and the throughput comparison.)"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .conftest import RemoteServer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow  # the real model over HTTP: about two minutes on 2 cores

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "skills", "address"]}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"]}}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}


@pytest.fixture(scope="module")
def server():
    # Two model threads (a 2-core host's default leaves one core to the frontend): this
    # module is mostly the engine's decode steps, the frontend and the client mostly wait.
    srv = RemoteServer("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--structured-outputs-config", '{"backend": "xgrammar"}',
                       "--cpu-threads", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe person number {i} as JSON."}]


def test_json_schema_answers_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def one(i: int):
        return client.chat.completions.create(model=MODEL, messages=ask(i), max_tokens=200,
                                              temperature=0.8, seed=i, response_format=fmt)

    with ThreadPoolExecutor(6) as pool:  # one batch in the engine
        for r in pool.map(one, range(6)):
            c = r.choices[0]
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_and_completions_json(client):
    with ThreadPoolExecutor(2) as pool:  # both in one batch
        chat = pool.submit(client.chat.completions.create, model=MODEL, messages=ask(0),
                           max_tokens=40, temperature=0,
                           response_format={"type": "json_object"})
        completion = pool.submit(client.completions.create, model=MODEL,
                                 prompt="A person as JSON:", max_tokens=150, temperature=0,
                                 extra_body={"structured_outputs": {
                                     "json": PERSON, "disable_any_whitespace": True}})
        c = chat.result().choices[0]
        text = completion.result().choices[0].text
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(c.message.content), dict)
    jsonschema.validate(json.loads(text), PERSON)


def test_regex_and_choice_hold_on_every_answer(client):
    pattern = r"[A-Z][a-z]{1,8} [0-9]{2,4}"

    def one(i: int) -> None:
        r = client.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=20,
                                      temperature=1.0, seed=i,
                                      extra_body={"structured_outputs": {"regex": pattern}})
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
        r = client.chat.completions.create(
            model=MODEL, messages=ask(i), max_tokens=10, temperature=1.0, seed=i,
            extra_body={"guided_choice": ["red", "green", "light blue"]})
        assert r.choices[0].message.content in ("red", "green", "light blue")

    with ThreadPoolExecutor(4) as pool:  # the four seeds in one batch
        list(pool.map(one, range(4)))


def _check_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named(client):
    def one(i: int) -> None:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Weather in city {i}?"}],
            max_tokens=150, temperature=0.7, seed=i, tools=TOOLS, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Time {i}?"}], max_tokens=100,
            temperature=0.7, seed=i, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert r.choices[0].finish_reason == "stop"
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        _check_calls(calls)

    with ThreadPoolExecutor(3) as pool:  # the three seeds in one batch
        list(pool.map(one, range(3)))


def _streamed(client, **kw) -> tuple[str, dict[int, dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or tc.id
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                "schema": PERSON}}},
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
])
def test_streaming_ends_as_the_full_answer(client, extra):
    kw = dict(model=MODEL, messages=ask(3), max_tokens=150, temperature=0, **extra)
    with ThreadPoolExecutor(2) as pool:  # both in one batch: half the steps
        full_answer = pool.submit(client.chat.completions.create, **kw)
        content, calls, finish = pool.submit(_streamed, client, **kw).result()
        full = full_answer.result().choices[0]
    assert finish == full.finish_reason
    if full.message.tool_calls:
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c.function.name, json.loads(c.function.arguments))
            for c in full.message.tool_calls]
        assert all(c["id"] for c in calls.values())
    else:
        assert content == full.message.content


def test_auto_tool_choice_parses_or_answers_in_text(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=60, temperature=0, tools=TOOLS)
    c = r.choices[0]
    if c.message.tool_calls:  # the parser found hermes calls
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message.tool_calls)
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")


def test_tool_results_reach_the_chat_template(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       temperature=0, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra,needle", [
    ({"structured_outputs": {"regex": "(?=a)b"}}, "Lookahead"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": 5}}}}, "json"),
    ({"guided_grammar": 'root ::= "a" |'}, "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"guided_decoding_backend": "outlines"}, "structured-outputs-config"),
    ({"tools": [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": t}}}}} for n, t in (("f", "integer"), ("g", "string"))],
      "tool_choice": "required"}, "$defs 'Item' differently"),
])
def test_bad_constraints_are_400_saying_why(client, extra, needle, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=5,
                                       stream=stream, extra_body=extra)
    assert needle in str(e.value)


def test_the_server_keeps_serving_after_bad_grammars(client):
    r = client.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=5,
                                       extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].message.content == "ok"


def test_responses_api_text_format(client):
    r = client.responses.create(model=MODEL, input="A person as JSON.", max_output_tokens=200,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


# ---- function calling in the Responses API ---------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the flat shape


def test_responses_api_function_calls_and_results(client):
    """tool_choice "required": function_call items whose arguments hold their schema; the
    call's result goes back as a function_call_output item naming its call_id."""
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=RESPONSES_TOOLS, tool_choice="required",
                                max_output_tokens=150, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id and call.id.startswith("fc_")
    assert {t.name for t in r.tools} == {"get_weather", "get_time"}
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 21, "sky": "clear"}'}])
    assert follow.status in ("completed", "incomplete") and follow.output_text is not None
    assert follow.usage.input_tokens > r.usage.input_tokens  # the call and result came along
    # the same turn given whole as input items, without previous_response_id
    again = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0, tools=RESPONSES_TOOLS,
        tool_choice="none",
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert [item.type for item in again.output] == ["message"]


def test_responses_api_named_function_streams_its_call(client):
    with client.responses.stream(model=MODEL, input="Time in Berlin?", tools=RESPONSES_TOOLS,
                                 tool_choice={"type": "function", "name": "get_time"},
                                 max_output_tokens=40, temperature=0) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["function_call"] and done[0].item.name == "get_time"
    args = next(e.arguments for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(args), SCHEMAS["get_time"])
    assert events[-1].response.output[0].arguments == args


@pytest.mark.parametrize("extra,needle", [
    ({"tools": [{"type": "web_search"}]}, "only 'function'"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "not in tools"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "cannot be combined"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
])
def test_responses_api_bad_tools_are_400s(server, extra, needle):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    r = server.post("/v1/responses", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
