"""Structured outputs on xgrammar (vLLM's default backend)."""

from __future__ import annotations

import json
import os
from typing import Any

import xgrammar as xgr

from shoal.structured_output.backend import GrammarBackend, GrammarMatcher, choice_grammar
from shoal.structured_output.params import StructuredOutputsParams


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


def fill_threads() -> int:
    """Threads for batched bitmask fills: half the CPUs this process may run on, at most 8
    (a fill takes a few microseconds a row; more threads cost more to wake than they save)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"
    fills_whole_rows = True  # no memset of the whole batch's bitmask first

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        # The model's vocabulary may be padded past the tokenizer's: the padding ids are
        # never allowed (their bits stay 0).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        # The manager's pool gives each compilation its own thread; xgrammar's cache is off
        # because the manager caches compiled grammars itself.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # Fills the rows of a big batch on several threads (C++, without the GIL). Not
        # "auto": that is half of std::thread::hardware_concurrency(), the host's cores, not
        # this process's share (64 threads in a 16-core container of a 128-core host).
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads())

    def compile(self, params: StructuredOutputsParams) -> Any:
        try:
            return self._compile(params)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            # xgrammar reports bad schemas, regexes and grammars as RuntimeError with the C++
            # location first; keep the reason.
            reason = str(e).strip().splitlines()[0]
            if "] " in reason and reason.startswith("["):
                reason = reason.split("] ", 1)[1]
            reason = reason.split(": ", 1)[1] if reason.startswith("/") else reason
            raise ValueError(f"structured_outputs.{params.kind} is invalid (the grammar engine "
                             f"could not compile it): {reason}") from None

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c = self._compiler
        ws = not p.disable_any_whitespace
        if p.json is not None:
            schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
            return c.compile_json_schema(schema, any_whitespace=ws,
                                         strict_mode=True)
        if p.json_object:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
        if p.regex is not None:
            return c.compile_regex(p.regex)
        if p.choice is not None:
            return c.compile_grammar(choice_grammar(p.choice))
        if p.grammar is not None:
            return c.compile_grammar(p.grammar)
        assert p.structural_tag is not None
        tag = json.loads(p.structural_tag)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's older form
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]
            return c.compile_structural_tag(items, tag.get("triggers", []))
        return c.compile_structural_tag(p.structural_tag)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Any,
                      rows: list[int] | None = None) -> None:
        if len(matchers) < 8:  # the thread hand-off costs more than a few rows
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        inner = [m._m for m in matchers if isinstance(m, XgrammarMatcher)]
        self._batch.batch_fill_next_token_bitmask(inner, bitmask, indices=rows)
