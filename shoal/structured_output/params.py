"""What a request constrains its output to (vLLM's StructuredOutputsParams), checked without
the grammar engine: that is imported by the engine core only (it loads torch).

Exactly one constraint is set. `key()` is what compiled grammars are cached under, so two
requests with the same schema share one compilation."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from shoal.json_arg import json_object

BACKENDS = ("auto", "xgrammar", "guidance")
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF / Lark-like, as the backend reads it)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag (got {', '.join(set_kinds) or 'none'})")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string")
        self._check_value(set_kinds[0])
        try:
            self.key()  # also what crosses to the engine: it must serialize
        except (RecursionError, TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{set_kinds[0]} cannot be serialized: "
                             f"{e}") from None

    def _check_value(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true when set")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    def key(self) -> tuple[str, str]:
        """(kind, spec text): the cache key of the compiled grammar. Options that change the
        grammar are part of the spec."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            spec = value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
            spec = _json.dumps({"schema": spec, "ws": self.disable_any_whitespace,
                                "strict": self.disable_additional_properties,
                                "ws_pattern": self.whitespace_pattern})
        elif kind == "choice":
            spec = _json.dumps(value)
        elif kind == "json_object":
            spec = _json.dumps({"ws": self.disable_any_whitespace,
                                "ws_pattern": self.whitespace_pattern})
        else:
            spec = value
        return kind, spec


def structured_outputs_from(value: Any) -> StructuredOutputsParams | None:
    """A request's `structured_outputs` as given (a dict from JSON, or the params)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object")
    known = {f for f in StructuredOutputsParams.__dataclass_fields__}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"structured_outputs has unknown field(s): {', '.join(unknown)}")
    return StructuredOutputsParams(**value)


def parse_backend_config(text: str | dict | None) -> str:
    """--structured-outputs-config '{"backend": ...}' -> the backend name."""
    if text is None:
        return "auto"
    config = json_object(text, "structured_outputs_config")
    unknown = sorted(set(config) - {"backend"})
    if unknown:
        raise ValueError(f"structured_outputs_config has unsupported field(s): "
                         f"{', '.join(unknown)} (supported: backend)")
    backend = config.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"structured_outputs_config backend must be one of "
                         f"{', '.join(BACKENDS)} (got {backend!r})")
    return backend


def check_backend_available(backend: str, find: Any = None) -> str:
    """The backend the engine will use. A backend named by the user must be installed (found
    without importing it: it loads torch). "auto" takes xgrammar, else llguidance, else
    "none": the engine starts, and a constrained request is refused with a 400 that says
    what to install (an image without either library still serves plain requests)."""
    import importlib.util

    find = find or importlib.util.find_spec
    if backend == "auto":
        for name, module in (("xgrammar", "xgrammar"), ("guidance", "llguidance")):
            if find(module) is not None:
                return name
        return "none"
    module = {"xgrammar": "xgrammar", "guidance": "llguidance"}[backend]
    if find(module) is None:
        raise ValueError(f"the {backend} structured outputs backend needs the {module} package, "
                         "which is not installed")
    return backend
