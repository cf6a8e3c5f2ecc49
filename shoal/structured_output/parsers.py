"""The reasoning and tool call parsers by name (--reasoning-parser, --tool-call-parser): the
text-format ones (reasoning_parsers.py, tool_parsers.py) and gpt-oss's harmony ones
(harmony.py, which builds on both)."""

from __future__ import annotations

from shoal.structured_output.harmony import HarmonyReasoningParser, HarmonyToolParser
from shoal.structured_output.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    builtin_reasoning_parser,
)
from shoal.structured_output.tool_parsers import TOOL_PARSERS, ToolParser, builtin_tool_parser

REASONING_PARSER_NAMES = (*REASONING_PARSERS, "openai_gptoss")
TOOL_PARSER_NAMES = (*TOOL_PARSERS, "openai")


def get_reasoning_parser(name: str) -> ReasoningParser:
    parser = HarmonyReasoningParser() if name == "openai_gptoss" else \
        builtin_reasoning_parser(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r} (supported: "
                         f"{', '.join(sorted(REASONING_PARSER_NAMES))})")
    return parser


def get_tool_parser(name: str) -> ToolParser:
    parser = HarmonyToolParser() if name == "openai" else builtin_tool_parser(name)
    if parser is None:
        raise ValueError(f"unknown tool call parser {name!r} (supported: "
                         f"{', '.join(sorted(TOOL_PARSER_NAMES))})")
    return parser
