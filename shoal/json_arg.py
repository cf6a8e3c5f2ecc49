"""Engine arguments that are objects: given as a dict from Python, or as JSON text on the
command line (--speculative-config, --pooler-config, --hf-overrides,
--structured-outputs-config). One parser, one wording for its errors."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def json_object(value: Any, name: str) -> dict[str, Any]:
    """`value` as a dict; a ValueError naming `name` when it is not one (or not JSON)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict (a JSON object on the command line), got "
                         f"{type(value).__name__}")
    return dict(value)


def json_object_of(value: Any, name: str, keys: Iterable[str]) -> dict[str, Any]:
    """json_object with only `keys` allowed ({} for None); a ValueError names the others."""
    if value is None:
        return {}
    obj = json_object(value, name)
    allowed = list(keys)
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; it takes "
                         f"{', '.join(allowed)}")
    return obj
