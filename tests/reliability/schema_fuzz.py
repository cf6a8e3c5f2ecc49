"""Requests generated from the server's own OpenAPI schema (schemathesis): valid ones
(positive) and ones that break the schema (negative), for every operation. None may get a
5xx. Shared by test_schema_fuzz.py (a small deterministic run) and
benchmarks/reliability_cpu.py (a long one)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode


@dataclass
class FuzzResult:
    cases: int = 0
    by_class: Counter = field(default_factory=Counter)  # "2xx", "4xx", "5xx", "error"
    server_errors: list[tuple[str, str, int, str]] = field(default_factory=list)


def fuzz(base_url: str, examples_per_operation: int, seed: int | None = 0) -> FuzzResult:
    """seed None: random; otherwise the same cases every run (derandomized)."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    out = FuzzResult()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run(op, mode, base_url, examples_per_operation, seed, out)
    return out


def _run(op, mode, base_url: str, n: int, seed: int | None, out: FuzzResult) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=n, deadline=None, derandomize=seed is not None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def one(case) -> None:
        out.cases += 1
        try:
            resp = case.call(base_url=base_url, timeout=60)
        except Exception as e:  # the server hung up or timed out: as bad as a 5xx
            out.by_class["error"] += 1
            out.server_errors.append((op.method, op.path, 0, f"{type(e).__name__}: {e}"))
            return
        out.by_class[f"{resp.status_code // 100}xx"] += 1
        if resp.status_code >= 500:
            out.server_errors.append((op.method.upper(), op.path, resp.status_code,
                                      resp.text[:300]))
    try:
        one()
    except Unsatisfiable:  # nothing to break: an operation without parameters or body
        pass
    except Exception as e:  # hypothesis could not generate for this operation: count it
        out.server_errors.append((op.method.upper(), op.path, -1, f"generation: {e}"[:300]))
