"""Trim a guidellm 0.8 JSON report to the per-benchmark summary figures (the full report keeps
every request and every distribution's pdf; this keeps the config, each sub-benchmark's
strategy, request counts and the medians/means/p99s of the usual serving metrics).

    .venv/bin/python benchmarks/guidellm_summary.py REPORT.json OUT.json [--meta KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from results_file import provenance, write

METRICS = ("requests_per_second", "request_concurrency", "request_latency",
           "time_to_first_token_ms", "time_per_output_token_ms", "inter_token_latency_ms",
           "output_tokens_per_second", "tokens_per_second", "prompt_token_count",
           "output_token_count")


def _dist(d: dict[str, Any] | None) -> dict[str, Any] | None:
    if not d:
        return None
    pct = d.get("percentiles") or {}
    return {"mean": d.get("mean"), "median": d.get("median"), "p99": pct.get("p99"),
            "min": d.get("min"), "max": d.get("max"), "count": d.get("count")}


def summarize(bench: dict[str, Any]) -> dict[str, Any]:
    cfg = bench.get("config", {})
    strategy = cfg.get("strategy", {})
    metrics = bench.get("metrics", {})
    out: dict[str, Any] = {
        "strategy": {k: strategy.get(k) for k in ("type_", "rate", "streams",
                                                   "max_concurrency") if k in strategy},
        "request_totals": metrics.get("request_totals"),
        "scheduler": {k: bench.get("scheduler_metrics", {}).get(k)
                      for k in ("start_time", "measure_start_time", "measure_end_time",
                                "end_time", "requests_made")},
        "warnings": bench.get("warnings"),
    }
    for name in METRICS:
        m = metrics.get(name)
        if isinstance(m, dict):
            out[name] = {status: _dist(m.get(status))
                         for status in ("successful", "incomplete", "errored", "total")
                         if m.get(status)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--meta", nargs="*", default=[], help="KEY=VALUE pairs to record")
    ns = p.parse_args()
    report = json.loads(ns.report.read_text())
    meta = dict(kv.split("=", 1) for kv in ns.meta)
    result = {**provenance(), **meta, "guidellm_metadata": report.get("metadata"),
              "guidellm_config": report.get("config"),
              "benchmarks": [summarize(b) for b in report.get("benchmarks", [])]}
    write(result, ns.out, indent=1)


if __name__ == "__main__":
    main()
