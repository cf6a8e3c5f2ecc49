"""Structured outputs without the model: request fields -> constraint, tool plans, the tool
call and reasoning parsers, and the streamed delta shaper."""

from __future__ import annotations

import json

import pytest

from shoal.entrypoints.openai.chat_stream_shaper import ChoiceShaper
from shoal.entrypoints.openai.constraints import request_constraint, response_format_params
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.tool_choice import ToolPlan, plan_tools, required_schema
from shoal.sampling_params import SamplingParams
from shoal.structured_output.params import (
    StructuredOutputsParams,
    check_backend_available,
    parse_backend_config,
)
from shoal.structured_output.parsers import get_reasoning_parser, get_tool_parser

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}}]


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{bad")
    assert StructuredOutputsParams(json='{"type": "object"}').kind == "json"


def test_cache_key_is_the_same_for_equal_schemas():
    a = StructuredOutputsParams(json={"type": "object", "required": [], "properties": {}})
    b = StructuredOutputsParams(json={"properties": {}, "required": [], "type": "object"})
    c = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    assert a.key() == b.key() != c.key()


def test_sampling_params_take_a_dict_and_need_history():
    sp = SamplingParams(structured_outputs={"regex": "[a-z]+"})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams)
    # The bitmask needs only the last token, which the engine core applies ahead: pipelined.
    assert not sp.needs_output_history
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_response_format_and_legacy_fields():
    assert response_format_params({"type": "text"}) is None
    assert response_format_params({"type": "json_object"}).json_object
    p = response_format_params({"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert p.json == {"type": "object"}
    with pytest.raises(ValueError, match="response_format.type"):
        response_format_params({"type": "yaml"})
    legacy = {"guided_json": None, "guided_regex": "[0-9]+", "guided_choice": None,
              "guided_grammar": None}
    assert request_constraint(None, None, legacy).regex == "[0-9]+"
    with pytest.raises(ValueError, match="not several"):
        request_constraint({"type": "json_object"}, {"regex": "a"}, {})
    with pytest.raises(ValueError, match="only one"):
        request_constraint(None, None, {"guided_regex": "a", "guided_choice": ["a"]})


def test_backend_config():
    assert parse_backend_config(None) == "auto"
    assert parse_backend_config('{"backend": "xgrammar"}') == "xgrammar"
    with pytest.raises(ValueError, match="must be one of"):
        parse_backend_config('{"backend": "outlines"}')
    with pytest.raises(ValueError, match="unsupported field"):
        parse_backend_config('{"backend": "xgrammar", "x": 1}')
    assert check_backend_available("xgrammar") == "xgrammar"
    assert check_backend_available("auto") == "xgrammar"
    only_guidance = {"llguidance": object()}.get
    assert check_backend_available("auto", only_guidance) == "guidance"
    assert check_backend_available("auto", {}.get) == "none"  # starts; refuses constraints
    with pytest.raises(ValueError, match="needs the llguidance package"):
        check_backend_available("guidance", {}.get)
    from shoal.structured_output.manager import make_backend

    with pytest.raises(ValueError, match="xgrammar or llguidance"):  # a constrained request's 400
        make_backend("none", object(), 512, [2])


def test_tool_plans():
    assert plan_tools(None, None, None, None, False).mode == "none"
    assert plan_tools(TOOLS, "none", None, None, False).mode == "none"
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        plan_tools(TOOLS, None, None, None, False)  # tools default to "auto"
    assert plan_tools(TOOLS, "auto", None, "hermes", True).parser is not None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                       None, None, False)
    assert named.mode == "named" and named.constraint.json["required"] == ["city"]
    with pytest.raises(ValueError, match="not in tools"):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, None, False)
    with pytest.raises(ValueError, match="needs tools"):
        plan_tools(None, "required", None, None, False)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        plan_tools([{"type": "function", "function": {}}], "required", None, None, False)
    req = plan_tools(TOOLS, "required", False, None, False)
    assert req.constraint.json["maxItems"] == 1


def test_required_schema_accepts_calls_of_any_tool():
    jsonschema = pytest.importorskip("jsonschema")
    schema = required_schema({"f": {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}, "g": {"type": "object"}}, None)
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}},
                         {"name": "g", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


def test_required_schema_refuses_conflicting_defs():
    """One $defs serves the whole array: a name two tools define differently is a 400, the
    same definition twice is fine (vLLM answers the same)."""
    from shoal.entrypoints.openai.tool_choice import ToolsError

    def tool(defn: dict) -> dict:
        return {"type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}},
                "$defs": {"Item": defn}}

    same = required_schema({"f": tool({"type": "integer"}), "g": tool({"type": "integer"})},
                           None)
    assert same["$defs"] == {"Item": {"type": "integer"}}
    with pytest.raises(ToolsError, match="\\$defs 'Item' differently .*'g'") as e:
        required_schema({"f": tool({"type": "integer"}), "g": tool({"type": "string"})}, None)
    assert e.value.param == "tools"


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Let me look.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "Let me look.", [("f", {"a": 1}), ("g", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": "x"}}', None,
     [("f", {"a": "x"})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "f", "arguments": {"a": 2}}]', "Sure",
     [("f", {"a": 2})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 3}', None, [("f", {"a": 3})]),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\n4\n</parameter>\n"
                  "<parameter=b>\nsome text\n</parameter>\n</function>\n</tool_call>", None,
     [("f", {"a": 4, "b": "some text"})]),
    ("pythonic", '[get_weather(city="Paris", days=[1, 2]), get_time()]', None,
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]),
    ("pythonic", '<|python_start|>[search(q="x", opts={"n": 3, "safe": True})]<|python_end|>',
     None, [("search", {"q": "x", "opts": {"n": 3, "safe": True}})]),
    ("pythonic", "[f(a=os.system('x'))]", "[f(a=os.system('x'))]", []),  # never evaluated
    ("pythonic", "[f(1)]", "[f(1)]", []),  # positional arguments have no names
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "It is sunny.", "It is sunny.", []),
])
def test_tool_parsers(parser, text, content, calls):
    out = get_tool_parser(parser).extract(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    assert all(c.id for c in out.calls)


def test_unknown_parsers_fail_at_start_up():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ServerSettings(tool_call_parser="pythonic_v9")
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ServerSettings(reasoning_parser="o1")


def test_reasoning_split_and_stream():
    qwen3 = get_reasoning_parser("qwen3")
    text = "<think>\nstep one</think>\n\nThe answer is 4."
    assert qwen3.split(text) == ("\nstep one", "The answer is 4.")
    assert qwen3.split("plain") == (None, "plain")
    assert get_reasoning_parser("deepseek_r1").split("cut off") == ("cut off", None)
    stream = qwen3.streamer()
    parts = [stream.feed(ch) for ch in text] + [stream.feed("", final=True)]
    assert "".join(r for r, _ in parts) == "\nstep one"
    assert "".join(c for _, c in parts) == "The answer is 4."


def _shape(plan: ToolPlan, text: str, reasoning=None) -> tuple[list[dict], str | None]:
    shaper = ChoiceShaper(plan, reasoning)
    deltas = [shaper.feed(ch, False) for ch in text[:-1]] + [shaper.feed(text[-1], True)]
    return [d for d in deltas if d], shaper.finish_reason("stop")


def test_shaper_streams_named_arguments_as_they_come():
    plan = ToolPlan("named", name="f")
    deltas, finish = _shape(plan, '{"a": 1}')
    first = deltas[0]["tool_calls"][0]
    assert first["id"] and first["function"]["name"] == "f" and first["type"] == "function"
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(args) == {"a": 1} and finish == "stop"


def test_shaper_holds_back_an_auto_call_and_sends_the_content():
    plan = ToolPlan("auto", parser=get_tool_parser("hermes"))
    deltas, finish = _shape(plan, 'Hi.<tool_call>{"name": "f", "arguments": {"x": 2}}'
                                  "</tool_call>")
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Hi." and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("f", {"x": 2})]


def test_shaper_required_sends_each_call_once_its_object_closes():
    plan = ToolPlan("required")
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    shaper = ChoiceShaper(plan, None)
    sent_after = []
    for i, ch in enumerate(text):
        d = shaper.feed(ch, i == len(text) - 1)
        for call in d.get("tool_calls", []):
            sent_after.append((i, call["index"], call["function"]["name"],
                               call["function"]["arguments"]))
    first_close = text.index("}}") + 1
    assert sent_after == [(first_close, 0, "f", '{"a": 1}'), (len(text) - 2, 1, "g", "{}")]
    assert shaper.finish_reason("stop") == "tool_calls"


def test_pythonic_holds_back_what_may_become_calls():
    parser = get_tool_parser("pythonic")
    assert parser.start_index("  [get_wea") == 0 and parser.start_index("<|pyth") == 0
    assert parser.start_index("The answer") is None
