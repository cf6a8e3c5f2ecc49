"""The grammar engine behind structured outputs: one interface, a backend per library.

A backend compiles a constraint once (`compile`, run in the manager's thread pool and cached)
and makes a cheap per-request matcher from it. Bitmasks are int32 words, bit j of word w
allowing token 32 * w + j: the layout xgrammar and llguidance both fill."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shoal.structured_output.params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    # The tokens whose acceptance may complete the grammar, when only they can (the step
    # loop then asks is_terminated() after them alone); None: after every token.
    stop_token_ids: frozenset[int] | None = None

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advances on a sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Writes the tokens allowed next into row `row` of an int32 bitmask tensor."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: the output is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forgets the last accepted tokens (speculative decoding's rejected drafts)."""


class GrammarBackend(ABC):
    name: str
    # Whether a fill writes every bit of its row (else the rows are set to all-allowed first).
    fills_whole_rows: bool = False

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; raises ValueError saying why a constraint is invalid."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        ...

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Any,
                      rows: list[int] | None = None) -> None:
        """Row rows[i] (default i) of `bitmask` for matchers[i]; a backend may fill the rows
        in parallel."""
        for i, m in enumerate(matchers):
            m.fill_bitmask(bitmask, i if rows is None else rows[i])


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON escapes are EBNF escapes)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
