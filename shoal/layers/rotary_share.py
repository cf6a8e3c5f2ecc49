"""Rotary modules shared by the layers of one model, and by no other model.

A long-context model's cos/sin table is tens of MiB, too much to repeat per layer, so every
layer of a model with the same settings gets one module (get_rope, get_mrope). The share
is weak (a module lives as long as a layer holds it: a dropped engine's tables go with its
model) and scoped to one model: build_model builds inside `one_model()`, a drafter's head
inside `one_model(target)` (it shares its target's tables). Two engines in one process never
share a table, so one engine's sleep, which frees its model's buffers (worker/sleep_mode.py),
cannot empty another's. Outside a scope (a model or layer built directly, as tests do)
modules built with the same settings share while alive."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

M = TypeVar("M")

_scopes = itertools.count(1)  # (never an id(): a freed scope's id could come back)
_SCOPE: contextvars.ContextVar[int | None] = contextvars.ContextVar("shoal_rotary_scope",
                                                                   default=None)
_of_model: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def one_model(target: Any = None) -> Iterator[int]:
    """Modules got inside are shared only with others got in the same scope: a new one, or
    `target`'s (a model remembered by remember()). Yields the scope."""
    scope = _of_model.get(target) if target is not None else None
    token = _SCOPE.set(scope if scope is not None else next(_scopes))
    try:
        yield _SCOPE.get()
    finally:
        _SCOPE.reset(token)


def remember(model: Any, scope: int) -> None:
    """`model` was built in `scope`: one_model(model) enters it again."""
    _of_model[model] = scope


class RotaryShare(Generic[M]):
    """Modules by settings, within the current scope, held weakly."""

    def __init__(self) -> None:
        self._modules: weakref.WeakValueDictionary[tuple, M] = weakref.WeakValueDictionary()

    def get(self, settings: Hashable, build: Callable[[], M]) -> M:
        key = (_SCOPE.get(), settings)
        module = self._modules.get(key)
        if module is None:
            module = build()
            self._modules[key] = module
        return module
