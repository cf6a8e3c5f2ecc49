"""Stop-string matching over streamed text (pure functions, no tokenizer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    start: int  # index in the searched text where it begins

    @property
    def end(self) -> int:
        return self.start + len(self.stop)


def find_stop(text: str, stops: Sequence[str], checked: int) -> StopMatch | None:
    """First stop string to complete in `text`, looking only at matches that end past `checked`.

    `checked` is how much of `text` was already searched, so only the new region plus an overlap
    of len(stop) - 1 chars is scanned. "First" means earliest end: that is the match a
    char-by-char stream would hit first, so the result does not depend on how tokens were
    batched. Equal ends prefer the longer (earlier-starting) stop.
    """
    best: StopMatch | None = None
    for stop in stops:
        if not stop:
            continue
        idx = text.find(stop, max(0, checked - len(stop) + 1))
        if idx < 0:
            continue
        match = StopMatch(stop, idx)
        if best is None or (match.end, match.start) < (best.end, best.start):
            best = match
    return best


def holdback_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    Those chars may turn out to be the start of a stop string, so they must not be streamed yet.
    """
    longest = max((len(s) for s in stops), default=0)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(s.startswith(tail) for s in stops if len(s) > len(tail)):
            return len(text) - i
    return 0
