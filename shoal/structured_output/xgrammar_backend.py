"""Structured outputs on xgrammar (vLLM's default backend)."""

from __future__ import annotations

import json
import os
from typing import Any

import xgrammar as xgr

from shoal.structured_output.backend import GrammarBackend, GrammarMatcher, choice_grammar
from shoal.structured_output.params import StructuredOutputsParams


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: frozenset[int]):
        self._m = matcher
        # A matcher made without terminate_without_stop_token ends only by accepting one of
        # these: StructuredRequest.accept asks is_terminated() after them alone.
        self.stop_token_ids = stop_token_ids
        # The step loop calls accept once a row per step: xgrammar's method itself, one
        # Python frame fewer than the method below.
        self.accept = matcher.accept_token  # type: ignore[method-assign]

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


# Rows below which one thread fills the whole batch. On the H200 host a row takes 3-6 us
# and waking xgrammar's threads about 60 us: 64 rows took 285 us on one thread, 288-378 us on
# 2, 4 or 8 (benchmarks/results/2026-12-03-structured-host-costs-H200-5b78dc7.json); only
# from a few hundred rows do threads pay (256 rows: 1,222 us on one, 753 on 8).
THREADED_FILL_ROWS = 128


def fill_threads() -> int:
    """Threads for batched bitmask fills of THREADED_FILL_ROWS rows or more: half the CPUs
    this process may run on, at most 8 (more threads cost more to wake than they save)."""
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
        # Batched fills: one C++ call for all rows (no Python frame per row), on one thread
        # below THREADED_FILL_ROWS rows, else on several. Not "auto": that is half of
        # std::thread::hardware_concurrency(), the host's cores, not this process's share (64
        # threads in a 16-core container of a 128-core host). The call lets go of the GIL,
        # but filling on a worker thread while the step loop applies the step before gained
        # nothing on the H200 (W1 json-async over free-async at matched batches: 0.981 with
        # it, 0.989 without, inside the run's noise; accepting tokens there lost, as
        # xgrammar's per-row calls hand the GIL back and forth), so the loop fills in line.
        # An xgrammar without the batch API fills row by row (GrammarBackend.fill_bitmasks).
        batch_cls = getattr(xgr, "BatchGrammarMatcher", None)
        self._batch_one = batch_cls(max_threads=1) if batch_cls is not None else None
        self._batch_many = (batch_cls(max_threads=fill_threads())
                            if batch_cls is not None and fill_threads() > 1 else self._batch_one)

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
        m = xgr.GrammarMatcher(compiled)
        return XgrammarMatcher(m, frozenset(m.stop_token_ids))

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Any,
                      rows: list[int] | None = None) -> None:
        batch = self._batch_many if len(matchers) >= THREADED_FILL_ROWS else self._batch_one
        if batch is None:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        batch.batch_fill_next_token_bitmask([m._m for m in matchers],  # type: ignore[attr-defined]
                                            bitmask, indices=rows)
