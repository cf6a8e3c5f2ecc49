"""A hand-written list of hostile requests for every endpoint (issue 18, item 1): wrong types,
out-of-range numbers, deeply nested or truncated JSON, invalid UTF-8 and lone surrogates,
oversized bodies and headers, unsupported content parts, empty and enormous prompts, long stop
lists, malicious chat templates. Each must get a 4xx with an OpenAI error body, none a 5xx.
Shared by tests/reliability/test_hostile_requests.py and benchmarks/reliability_cpu.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # a JSON value, or bytes sent as they are
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None  # the exact 4xx expected, where it is known

    def request_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"headers": {"content-type": "application/json", **self.headers}}
        if isinstance(self.body, bytes):
            kw["content"] = self.body
        elif self.body is not None:
            kw["content"] = json.dumps(self.body).encode()
        return kw


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]


def _completion_cases() -> list[Case]:
    p = {"prompt": "hi", "max_tokens": 4}
    c = [Case("prompt is a number", CMPL, {"prompt": 123}),
         Case("prompt is null", CMPL, {"prompt": None}),
         Case("prompt is empty", CMPL, {"prompt": ""}),
         Case("prompt is an empty list", CMPL, {"prompt": []}),
         Case("prompt mixes strings and ids", CMPL, {"prompt": ["a", 1]}),
         Case("token id out of vocabulary", CMPL, {"prompt": [10**9]}),
         Case("negative token id", CMPL, {"prompt": [-1]}),
         Case("float token ids", CMPL, {"prompt": [1.5, 2.5]}),
         Case("enormous prompt", CMPL, {"prompt": "word " * 200_000, "max_tokens": 1}),
         Case("5,000 prompts", CMPL, {"prompt": ["hi"] * 5000, "max_tokens": 1}),
         Case("lone surrogate", CMPL, b'{"prompt": "bad \\ud800 text", "max_tokens": 1}'),
         Case("invalid UTF-8", CMPL, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}'),
         Case("no body", CMPL, None),
         Case("body is a list", CMPL, [1, 2, 3]),
         Case("body is a string", CMPL, "prompt"),
         Case("truncated JSON", CMPL, b'{"prompt": "hi", "max_tokens": '),
         Case("deeply nested JSON", CMPL,
              b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
         Case("not JSON at all", CMPL, b"\x00\x01\x02garbage", headers={
             "content-type": "application/octet-stream"}),
         Case("infinite temperature", CMPL, b'{"prompt": "hi", "temperature": 1e999}'),
         Case("NaN top_p", CMPL, b'{"prompt": "hi", "top_p": NaN}'),
         Case("unknown model", CMPL, {**p, "model": "no-such-model"}, status=404),
         Case("unsupported suffix", CMPL, {**p, "suffix": "x"})]
    for name, extra in [
            ("n of 100,000", {"n": 100_000}), ("negative n", {"n": -1}), ("n is a string",
                                                                          {"n": "3"}),
            ("huge max_tokens", {"max_tokens": 10**12}), ("negative max_tokens",
                                                           {"max_tokens": -5}),
            ("temperature is a word", {"temperature": "hot"}), ("top_p above 1", {"top_p": 2}),
            ("seed beyond 64 bits", {"seed": 2**70}), ("seed below -2**63", {"seed": -2**70}),
            ("logprobs beyond 20", {"logprobs": 21}), ("logprobs of a billion",
                                                        {"logprobs": 10**9}),
            ("huge logit_bias value", {"logit_bias": {"1": 1e9}}),
            ("logit_bias id out of vocabulary", {"logit_bias": {"99999999": 1}}),
            ("logit_bias id is not a number", {"logit_bias": {"abc": 1}}),
            ("logit_bias with 200,000 entries", {"logit_bias": {str(i): 1 for i in
                                                               range(200_000)}}),
            ("1,000 stop strings", {"stop": ["x"] * 1000}),
            ("a 100,000-character stop string", {"stop": ["x" * 100_000]}),
            ("stop is a number", {"stop": 5}), ("stream is a word", {"stream": "yes"}),
            ("priority of 10**30",
                                                          {"priority": 10**30}),
            ("min_tokens above max_tokens", {"min_tokens": 10}),
            ("echo with huge logprobs", {"echo": True, "logprobs": 10**6}),
            ("stop_token_ids out of vocabulary", {"stop_token_ids": [10**9]})]:
        c.append(Case(name, CMPL, {**p, **extra}))
    return c


def _chat_cases() -> list[Case]:
    def chat(name: str, **body: Any) -> Case:
        return Case(name, CHAT, {"messages": OK_CHAT, "max_tokens": 4, **body})

    def part(kind: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": kind, kind: {"url": "http://x/y.png"}}]}]

    return [
        chat("messages is a string", messages="hi"), chat("no messages", messages=[]),
        chat("message without a role", messages=[{"content": "hi"}]),
        chat("role is a number", messages=[{"role": 5, "content": "hi"}]),
        chat("content is a number", messages=[{"role": "user", "content": 5}]),
        chat("image part", messages=part("image_url")),
        chat("audio part", messages=part("input_audio")),
        chat("unknown part type", messages=part("hologram")),
        chat("text part without text", messages=[{"role": "user", "content": [
            {"type": "text"}]}]),
        chat("huge range in chat_template",
             chat_template="{% for i in range(10**9) %}x{% endfor %}"),
        chat("nested loops in chat_template", chat_template=(
            "{% set r = range(10000) %}{% for i in r %}{% for j in r %}{% endfor %}"
            "{% endfor %}")),
        chat("doubling string in chat_template", chat_template=(
            "{% set ns = namespace(s='x') %}{% for i in range(100) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}")),
        chat("python objects in chat_template",
             chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"),
        chat("chat_template syntax error", chat_template="{% for %}"),
        chat("chat_template_kwargs is a string", chat_template_kwargs="x"),
        chat("lone surrogate in content", messages=[{"role": "user", "content": "\ud800"}]),
        chat("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat("json_schema of an unknown type", response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        chat("regex the grammar engine cannot compile",
             structured_outputs={"regex": "(?<=a)b"}),
        chat("unbalanced EBNF grammar", guided_grammar='root ::= ("a"'),
        chat("tool_choice naming a missing tool", tools=[
            {"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}}),
        chat("top_logprobs of 50", logprobs=True, top_logprobs=50),
        chat("n of 100,000", n=100_000), chat("negative max_completion_tokens",
                                              max_completion_tokens=-1),
        chat("enormous message", messages=[{"role": "user", "content": "word " * 200_000}]),
    ]


def _other_cases() -> list[Case]:
    return [
        Case("tokenize a number", "/tokenize", {"prompt": 5}),
        Case("tokenize a lone surrogate", "/tokenize", b'{"prompt": "\\udfff"}'),
        Case("tokenize with a hostile template", "/tokenize", {
            "messages": OK_CHAT, "chat_template": "{% for i in range(10**9) %}x{% endfor %}"}),
        Case("detokenize a huge id", "/detokenize", {"tokens": [10**12]}),
        Case("detokenize a negative id", "/detokenize", {"tokens": [-1]}),
        Case("detokenize a string", "/detokenize", {"tokens": "abc"}),
        Case("responses with a number input", "/v1/responses", {"input": 5}),
        Case("batch chat with garbage", "/v1/chat/completions/batch", {"messages": 7}),
        Case("invocations with garbage", "/invocations", {"foo": "bar"}),
        Case("path traversal in a model id", "/v1/models/..%2F..%2Fetc%2Fpasswd", method="GET",
             status=404),
        Case("unknown route", "/v1/nonexistent", method="GET", status=404),
        Case("wrong method", CMPL, method="PUT", status=405),
        Case("oversized body (40 MiB)", CMPL, b'{"prompt": "' + b"x" * (40 << 20) + b'"}',
             status=413),
        Case("oversized header (100 KiB)", CMPL, {"prompt": "hi", "max_tokens": 1},
             headers={"x-junk": "y" * (100 << 10)}, status=431),
    ]


def hostile_cases() -> list[Case]:
    return _completion_cases() + _chat_cases() + _other_cases()
