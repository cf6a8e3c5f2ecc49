"""A request's output constraint from the ways the API spells it: OpenAI's response_format,
vLLM's structured_outputs, and its older guided_* fields. At most one may be given."""

from __future__ import annotations

import json
from typing import Any

from shoal.structured_output.params import StructuredOutputsParams, structured_outputs_from

# vLLM's older request fields -> the StructuredOutputsParams field they set.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def response_format_params(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text, json_object, json_schema, or vLLM's structural_tag."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI allows leaving the schema out: any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        body = {k: v for k, v in rf.items()}
        return StructuredOutputsParams(structural_tag=json.dumps(body))
    raise ValueError(f"response_format.type must be text, json_object, json_schema or "
                     f"structural_tag (got {kind!r})")


def _legacy_params(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    given = {GUIDED_FIELDS[k]: v for k, v in fields.items()
             if k in GUIDED_FIELDS and v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"only one of {', '.join(GUIDED_FIELDS)} may be set")
    ws = fields.get("guided_whitespace_pattern")
    if isinstance(given.get("json"), str):  # a schema as text
        try:
            given["json"] = json.loads(given["json"])
        except ValueError as e:
            raise ValueError(f"guided_json is not valid JSON: {e}") from None
    return StructuredOutputsParams(**given, whitespace_pattern=ws)


def request_constraint(response_format: dict[str, Any] | None, structured_outputs: Any,
                       legacy: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one constraint of a request, or None. Raises ValueError naming the field."""
    found = []
    try:
        so = structured_outputs_from(structured_outputs)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("structured_outputs")
                         else f"structured_outputs is invalid: {e}") from None
    for name, params in (("response_format", response_format_params(response_format)),
                         ("structured_outputs", so),
                         ("guided_*", _legacy_params(legacy))):
        if params is not None:
            found.append((name, params))
    if len(found) > 1:
        raise ValueError(f"structured_outputs: give one output constraint, not several "
                         f"({', '.join(n for n, _ in found)})")
    return found[0][1] if found else None
