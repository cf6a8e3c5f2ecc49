"""Structured outputs on llguidance (vLLM's `guidance` backend)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch

from shoal.structured_output.backend import GrammarBackend, GrammarMatcher
from shoal.structured_output.params import StructuredOutputsParams


class GuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.consume_token(token_id) and not self._m.is_error()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        # n_vocab: the model's (maybe padded) vocabulary; ids past the tokenizer's are never
        # allowed.
        self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                 eos_token=sorted(eos_token_ids) or None)

    def compile(self, params: StructuredOutputsParams) -> Any:
        try:
            grammar = self._grammar(params)
            error = llguidance.LLMatcher.validate_grammar(grammar, self._tok)
        except (ValueError, TypeError, RecursionError) as e:
            error = str(e)
        if error:
            reason = " ".join(str(error).split())
            raise ValueError(f"structured_outputs.{params.kind} is invalid (the grammar engine "
                             f"could not compile it): {reason}")
        return grammar

    @staticmethod
    def _grammar(p: StructuredOutputsParams) -> str:
        ws = {"whitespace_flexible": not p.disable_any_whitespace}
        if p.json is not None or p.json_object:
            schema = {"type": "object"} if p.json_object else p.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=ws)
        if p.regex is not None:
            return llguidance.grammar_from("regex", p.regex)
        if p.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(p.choice))
        if p.grammar is not None:
            return llguidance.grammar_from("grammar", p.grammar)
        raise ValueError("structural tags are not supported by the guidance backend; use "
                         "the xgrammar backend")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return GuidanceMatcher(llguidance.LLMatcher(self._tok, compiled))
