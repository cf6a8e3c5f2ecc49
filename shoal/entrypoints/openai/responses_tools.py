"""Function calling in the Responses API: its tools, tool_choice and items in the shapes of
/v1/responses, mapped onto the chat path's tool plans (tool_choice.py).

- tools: `{"type": "function", "name", "description", "parameters"}` (flat) -> the chat
  form `{"type": "function", "function": {...}}`; other tool types (web_search, file_search,
  ...) are refused by name.
- tool_choice: "auto" | "none" | "required" | `{"type": "function", "name"}`.
- input items: `function_call` (an earlier call of the model) and `function_call_output`
  (its result) become an assistant message with tool_calls and a tool message.
- output: a `message` item for the text beside the calls (when there is some, or no call),
  then one `function_call` item per call (`call_id` is what the result must name)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from shoal.entrypoints.openai.errors import OpenAIError
from shoal.structured_output.tool_parsers import ToolCall


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise OpenAIError(400, f"tools of type {kind!r} are not supported; only "
                                   "'function'", f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def input_item_messages(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call or function_call_output input item as a chat message."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise OpenAIError(400, f"a {item.get('type')} item needs a string call_id", where)
    if item["type"] == "function_call":
        name, args = item.get("name"), item.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(args, str):
            raise OpenAIError(400, "a function_call item needs a name and arguments text",
                              where)
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {
                "name": name, "arguments": template_arguments(args, where)}}]}
    output = item.get("output")
    if not isinstance(output, str):
        raise OpenAIError(400, "a function_call_output item needs its output as text", where)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def template_arguments(args: str, where: str) -> Any:
    """Arguments as the chat templates read them (a mapping, as transformers passes them)."""
    try:
        return json.loads(args) if args.strip() else {}
    except ValueError:
        raise OpenAIError(400, "function call arguments must be JSON text", where) from None


def function_call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
            "call_id": "call_" + uuid.uuid4().hex[:24], "name": call.name,
            "arguments": call.arguments, "status": status}


def assistant_turn(content: str | None, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as the stored conversation's assistant message (its calls as the chat
    template expects them, with their call ids)."""
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"],
                           "arguments": template_arguments(it["arguments"], "output")}}
             for it in items if it["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        turn["tool_calls"] = calls
    return turn
