"""Tool calls parsed from a model's text (tool_choice "auto"), one parser per format family,
chosen by --tool-call-parser as in vLLM: hermes (Qwen2.5/Qwen3, Hermes), llama3_json
(Llama 3.x JSON calls), mistral ([TOOL_CALLS]), qwen3_xml (Qwen3-Coder's XML calls), pythonic
([f(a=1), g()]) and openai (gpt-oss's harmony calls: harmony.py).

A parser also says where tool calls may begin in a partial text (`start_index`), so a stream
sends the content before them as it comes and holds back what may become a call."""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text besides the calls (None when there is none)
    calls: list[ToolCall]


def _arguments_text(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return json.dumps(value)
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call_from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return ToolCall(obj["name"], _arguments_text(args))


def _partial_marker_start(text: str, marker: str) -> int | None:
    """Where a marker that the text ends with the beginning of would start."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


class ToolParser(ABC):
    name: ClassVar[str]
    marker: ClassVar[str] = ""

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole answer; text that is not a well-formed call stays content."""

    def start_index(self, text: str) -> int | None:
        """Where tool calls begin (or may begin) in a partial answer; None: all content."""
        i = text.find(self.marker)
        if i >= 0:
            return i
        return _partial_marker_start(text, self.marker)

    @staticmethod
    def _content(text: str) -> str | None:
        return text if text.strip() else None


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them."""

    name = "hermes"
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call_from_obj(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return ExtractedToolCalls(text, [])  # malformed: leave the text as it is
            calls.append(call)
        return ExtractedToolCalls(self._content(text[:start]), calls)


class Llama3JsonToolParser(ToolParser):
    """A whole answer of JSON calls {"name": ..., "parameters": {...}} (after an optional
    <|python_tag|>), separated by ';'."""

    name = "llama3_json"
    marker = "<|python_tag|>"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        decoder = json.JSONDecoder()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return ExtractedToolCalls(text, [])
            call = _call_from_obj(obj)
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
            i = end
            while i < len(body) and body[i] in "; \n\t":
                i += 1
        return ExtractedToolCalls(None, calls)

    def start_index(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self.marker)) or \
                self.marker.startswith(stripped):
            return 0  # may still become a call: nothing is content yet
        return None


class MistralToolParser(ToolParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or the newer
    [TOOL_CALLS]name[ARGS]{...} per call."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls = self._calls(text[start:])
        if calls is None:
            return ExtractedToolCalls(text, [])
        for c in calls:  # Mistral's templates expect 9-character alphanumeric ids
            c.id = "".join(secrets.choice(self._ID_CHARS) for _ in range(9))
        return ExtractedToolCalls(self._content(text[:start]), calls)

    def _calls(self, text: str) -> list[ToolCall] | None:
        parts = [p.strip() for p in text.split(self.marker) if p.strip()]
        calls: list[ToolCall] = []
        for part in parts:
            if "[ARGS]" in part:
                name, args = part.split("[ARGS]", 1)
                try:
                    calls.append(ToolCall(name.strip(), _arguments_text(json.loads(args))))
                except ValueError:
                    return None
                continue
            try:
                obj = json.loads(part)
            except ValueError:
                return None
            for item in obj if isinstance(obj, list) else [obj]:
                call = _call_from_obj(item)
                if call is None:
                    return None
                calls.append(call)
        return calls or None


class Qwen3XmlToolParser(ToolParser):
    """<tool_call><function=name><parameter=p>value</parameter>...</function></tool_call>;
    values are JSON where they parse as JSON, else strings."""

    name = "qwen3_xml"
    marker = "<tool_call>"
    _FUNC = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls = []
        for name, body in self._FUNC.findall(text[start:]):
            args = {}
            for key, raw in self._PARAM.findall(body):
                value = raw.strip("\n")
                try:
                    args[key.strip()] = json.loads(value)
                except ValueError:
                    args[key.strip()] = value
            calls.append(ToolCall(name.strip(), json.dumps(args, ensure_ascii=False)))
        if not calls:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(self._content(text[:start]), calls)


class PythonicToolParser(ToolParser):
    """A whole answer that is a Python list of calls with keyword arguments of literal values,
    `[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4 and others; Llama 4 may wrap it
    in <|python_start|> ... <|python_end|>). Read with Python's own parser, never evaluated:
    an argument that is not a literal (a name, a call) leaves the text as content."""

    name = "pythonic"
    marker = "["
    _WRAP = ("<|python_start|>", "<|python_end|>")

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(self._WRAP[0]):
            body = body[len(self._WRAP[0]):].removesuffix(self._WRAP[1]).strip()
        if not body.startswith("["):
            return ExtractedToolCalls(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return ExtractedToolCalls(text, [])
        if not isinstance(tree, ast.List) or not tree.elts:
            return ExtractedToolCalls(text, [])
        calls = []
        for node in tree.elts:
            call = self._call(node)
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
        return ExtractedToolCalls(None, calls)

    @staticmethod
    def _call(node: ast.expr) -> ToolCall | None:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)  # f, or a dotted name such as tools.search
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                return None
        try:
            return ToolCall(name, json.dumps(args, ensure_ascii=False))
        except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
            return None

    def start_index(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("[", self._WRAP[0])) or \
                self._WRAP[0].startswith(stripped):
            return 0  # may still become a list of calls: nothing is content yet
        return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        Qwen3XmlToolParser, PythonicToolParser)}


def builtin_tool_parser(name: str) -> ToolParser | None:
    """The text-format parsers here; shoal/structured_output/parsers.py looks up every
    name."""
    cls = TOOL_PARSERS.get(name)
    return cls() if cls is not None else None
