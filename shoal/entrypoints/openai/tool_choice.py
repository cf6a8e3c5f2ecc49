"""tools / tool_choice of a chat request: what the model is constrained to and how its answer
becomes tool calls.

- "none": the model sees the tools (chat template) and answers with text.
- "auto" (the default when tools are given): free text, tool calls parsed from it by the
  --tool-call-parser (needs --enable-auto-tool-choice, as in vLLM).
- "required": the output is constrained to a JSON array of {"name", "parameters"} objects, one
  per call, each matching one tool's parameter schema (vLLM's schema).
- a named function: the output is constrained to that tool's parameter schema; it is the
  call's arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shoal.structured_output.params import StructuredOutputsParams
from shoal.structured_output.parsers import get_tool_parser
from shoal.structured_output.tool_parsers import ToolCall, ToolParser

_EMPTY_PARAMS = {"type": "object", "properties": {}}


class ToolsError(ValueError):
    """tools or tool_choice is wrong (a 400); `param` names which."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    constraint: StructuredOutputsParams | None = None
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto

    def calls_from_text(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole answer."""
        if self.mode == "named":
            return None, [ToolCall(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut off by max_tokens: no calls, the text as it is
                return text, []
            return None, [ToolCall(i["name"], json.dumps(i.get("parameters", {}),
                                                          ensure_ascii=False))
                          for i in items]
        if self.mode == "auto" and self.parser is not None:
            extracted = self.parser.extract(text)
            return extracted.content, extracted.calls
        return text, []


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, checking each tool's shape (400s that say what is wrong)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolsError(f"tools[{i}] must be an object of type 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolsError(f"tools[{i}].function must be an object with a non-empty 'name'",
                             "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object",
                             "tools")
        out[fn["name"]] = params or _EMPTY_PARAMS
    return out


def required_schema(functions: dict[str, dict[str, Any]], parallel: bool | None) -> dict:
    """A JSON array of calls, each {"name": <one tool>, "parameters": <its schema>}."""
    defs: dict[str, Any] = {}
    variants = []
    for name, params in functions.items():
        params = dict(params)
        for key, definition in (params.pop("$defs", {}) or {}).items():
            # one $defs for the whole array: a name two tools define differently would make
            # one of them validate against the other's shape (vLLM refuses it too)
            if key in defs and defs[key] != definition:
                raise ToolsError(f"tool_choice 'required': tools define $defs {key!r} "
                                 f"differently (function {name!r} and an earlier one); rename "
                                 "one of them", "tools")
            defs[key] = definition
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               auto_parser: str | None, enable_auto: bool) -> ToolPlan:
    """What the request's tools ask for; ToolsError (400) when they are inconsistent."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        if tools:
            _functions(tools)
        return ToolPlan("none")
    if not tools:
        raise ToolsError("tool_choice needs tools: give the functions the model may call",
                         "tool_choice")
    functions = _functions(tools)
    if tool_choice == "auto":
        if not enable_auto or auto_parser is None:
            raise ToolsError('tool_choice "auto" requires --enable-auto-tool-choice and '
                             "--tool-call-parser to be set", "tool_choice")
        return ToolPlan("auto", parser=get_tool_parser(auto_parser))
    if tool_choice == "required":
        return ToolPlan("required", StructuredOutputsParams(
            json=required_schema(functions, parallel_tool_calls)))
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolsError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in functions:
            raise ToolsError(f"tool_choice names the function {name!r}, which is not in tools "
                             f"(tools: {', '.join(functions)})", "tool_choice")
        return ToolPlan("named", StructuredOutputsParams(json=functions[name]), name=name)
    raise ToolsError(f'tool_choice must be "none", "auto", "required" or a named function '
                     f"(got {tool_choice!r})", "tool_choice")
