"""gpt-oss's harmony turns: the reasoning parser openai_gptoss and the tool call parser openai,
on whole answers and streamed ones (cut at every character), alone and through the chat
stream shaper as the server uses them."""

from __future__ import annotations

import json

import pytest

from shoal.entrypoints.openai.chat_stream_shaper import ChoiceShaper
from shoal.entrypoints.openai.tool_choice import ToolPlan
from shoal.structured_output.harmony import parse_messages, split_harmony
from shoal.structured_output.parsers import get_reasoning_parser, get_tool_parser

ANSWER = ("<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
CALL_RECIPIENT_FIRST = ("<|channel|>analysis<|message|>ok<|end|><|start|>assistant "
                        "to=functions.lookup<|channel|>commentary json<|message|>"
                        '{"q": 1}<|call|>')
PREAMBLE = ("<|channel|>commentary<|message|>Checking two cities.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>"
            '{"city": "Oslo"}<|call|>')


def test_reasoning_and_answer_of_a_whole_turn():
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.keeps_special_tokens
    assert parser.split(ANSWER) == ("The user greets. Reply briefly.", "Hello! How can I help?")


def test_text_without_markers_is_all_answer():
    assert split_harmony("plain text") == (None, "plain text")
    assert split_harmony("") == (None, None)


@pytest.mark.parametrize("turn, name, args, content", [
    (CALL, "get_weather", {"city": "Paris"}, None),
    (CALL_RECIPIENT_FIRST, "lookup", {"q": 1}, None),
    (PREAMBLE, "get_weather", {"city": "Oslo"}, "Checking two cities."),
])
def test_tool_calls_after_the_reasoning_split(turn, name, args, content):
    reasoning, rest = get_reasoning_parser("openai_gptoss").split(turn)
    tools = get_tool_parser("openai")
    for text in (rest, turn):  # after the reasoning parser, or from the raw turn
        out = tools.extract(text)
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [(name, args)]
        assert out.content == content
    assert (reasoning is None) == (turn is PREAMBLE)  # the preamble turn has no analysis
    assert "<|" not in (reasoning or "")


def test_messages_of_a_partial_turn():
    msgs = parse_messages(CALL[:CALL.index("<|message|>{")])
    assert [m.channel for m in msgs] == ["analysis", "commentary"]
    assert msgs[1].recipient is None and not msgs[1].header_done  # its header is not read yet
    msgs = parse_messages(CALL[:-len("<|call|>")])
    assert msgs[1].recipient == "functions.get_weather" and msgs[1].content_type == "json"
    assert msgs[1].body == '{"city": "Paris"}' and not msgs[1].done


@pytest.mark.parametrize("turn", [ANSWER, CALL, PREAMBLE])
def test_a_stream_cut_anywhere_adds_up_to_the_whole(turn):
    """Deltas never take back text, never show a marker, and add up to the whole split."""
    want_reasoning, want_answer = split_harmony(turn)
    stream = get_reasoning_parser("openai_gptoss").streamer()
    reasoning = answer = ""
    for i, ch in enumerate(turn):
        r, a = stream.feed(ch, final=i == len(turn) - 1)
        reasoning, answer = reasoning + r, answer + a
        assert "<|" not in reasoning
    assert reasoning == (want_reasoning or "") and answer == (want_answer or "")


def test_the_chat_shaper_streams_reasoning_content_and_calls():
    """As the server streams: reasoning deltas, content without markup, the call at the end."""
    shaper = ChoiceShaper(ToolPlan("auto", parser=get_tool_parser("openai")),
                          get_reasoning_parser("openai_gptoss"))
    deltas = [shaper.feed(ch, final=i == len(PREAMBLE) - 1) for i, ch in enumerate(PREAMBLE)]
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Checking two cities." and reasoning == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert shaper.finish_reason("stop") == "tool_calls"


def test_the_chat_server_keeps_special_tokens_for_them():
    from shoal.entrypoints.openai.serving_chat import OpenAIServingChat

    class Settings:
        reasoning_parser = "openai_gptoss"

    serving = OpenAIServingChat.__new__(OpenAIServingChat)
    serving.settings = Settings()
    assert serving._format_in_special_tokens(None)
    Settings.reasoning_parser = "qwen3"
    assert not serving._format_in_special_tokens(ToolPlan("none"))
    assert serving._format_in_special_tokens(ToolPlan("auto", parser=get_tool_parser("openai")))


def test_unknown_names_list_the_new_parsers():
    with pytest.raises(ValueError, match="openai_gptoss"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="openai"):
        get_tool_parser("nope")
