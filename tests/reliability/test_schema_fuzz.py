"""The server's OpenAPI schema drives a small deterministic fuzz run (schemathesis; the long
run is benchmarks/reliability_cpu.py): no generated request, valid or not, gets a 5xx."""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis")

from schema_fuzz import fuzz  # noqa: E402


def test_schema_generated_requests_never_get_a_5xx(null_server):
    # The null server's short context keeps generated max_tokens refused or small.
    result = fuzz(null_server.base_url, examples_per_operation=8, seed=0)
    assert result.server_errors == []
    assert result.cases > 100 and result.by_class["4xx"] > 0 and result.by_class["2xx"] > 0
