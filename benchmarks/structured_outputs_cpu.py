"""Structured outputs on this CPU (issue 15): validity and cost, through `shoal serve` with the
official openai client, on the embedded SmolLM2.

    .venv/bin/python benchmarks/structured_outputs_cpu.py             # the full run
    .venv/bin/python benchmarks/structured_outputs_cpu.py --smoke     # a quick check

1. 50 chat requests with a non-trivial JSON schema (nested object, enums, an array, required
   fields, a pattern), sampled at temperature 0.8 with distinct seeds: every answer must parse
   and validate (jsonschema). Also regex and choice requests, and tool_choice required / named
   calls whose arguments must validate against the tool's schema.
2. Cost: 64 constrained against 64 unconstrained requests (the same prompts and max_tokens,
   all sent at once), output tokens per second of each batch.

Results: benchmarks/results/<date>-structured-outputs-cpu.json (or --out)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from bench_args import add_common  # noqa: E402
from results_file import cpu_model, default_path, provenance, write  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "skills", "address"]}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
REGEX = r"[A-Z][a-z]{1,8} [0-9]{2,4}"
CHOICES = ["red", "green", "light blue"]


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe person number {i} as JSON."}]


def run_all(fn: Any, items: list[Any], workers: int) -> list[Any]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def json_schema_figures(client: Any, n: int) -> dict[str, Any]:
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def one(i: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(model=MODEL, messages=ask(i), max_tokens=250,
                                           temperature=0.8, seed=i, response_format=fmt)
        return r.choices[0].message.content, r.choices[0].finish_reason

    t0 = time.perf_counter()
    answers = run_all(one, list(range(n)), 16)
    valid, failures = 0, []
    for text, finish in answers:
        try:
            jsonschema.validate(json.loads(text), PERSON)
            valid += 1
        except Exception as e:  # noqa: BLE001 - counted and reported
            failures.append({"finish_reason": finish, "text": text[:300], "error": str(e)[:200]})
    return {"requests": n, "valid": valid, "finish_reasons": _count(f for _, f in answers),
            "seconds": round(time.perf_counter() - t0, 1), "failures": failures[:5],
            "example": answers[0][0]}


def regex_choice_tool_figures(client: Any, n: int) -> dict[str, Any]:
    import jsonschema

    def regex(i: int) -> bool:
        r = client.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=20,
                                      temperature=1.0, seed=i,
                                      extra_body={"structured_outputs": {"regex": REGEX}})
        return re.fullmatch(REGEX, r.choices[0].text) is not None

    def choice(i: int) -> bool:
        r = client.chat.completions.create(model=MODEL, messages=ask(i), max_tokens=10,
                                           temperature=1.0, seed=i,
                                           extra_body={"guided_choice": CHOICES})
        return r.choices[0].message.content in CHOICES

    def tool(args: tuple[int, Any]) -> bool:
        i, tool_choice = args
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Weather in city {i}?"}],
            max_tokens=120, temperature=0.7, seed=i, tools=TOOLS, tool_choice=tool_choice)
        calls = r.choices[0].message.tool_calls or []
        try:
            for c in calls:
                jsonschema.validate(json.loads(c.function.arguments), WEATHER)
        except Exception:  # noqa: BLE001 - an invalid call is what is counted
            return False
        return bool(calls)

    named = {"type": "function", "function": {"name": "get_weather"}}
    return {
        "regex_holds": f"{sum(run_all(regex, list(range(n)), 8))}/{n}",
        "choice_holds": f"{sum(run_all(choice, list(range(n)), 8))}/{n}",
        "tool_required_valid": f"{sum(run_all(tool, [(i, 'required') for i in range(n)], 8))}/{n}",
        "tool_named_valid": f"{sum(run_all(tool, [(i, named) for i in range(n)], 8))}/{n}",
    }


def throughput(client: Any, n: int, constrained: bool, max_tokens: int) -> dict[str, Any]:
    extra = ({"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "person", "schema": PERSON}}}
             if constrained else {})

    def one(i: int) -> tuple[int, str | None]:
        r = client.chat.completions.create(model=MODEL, messages=ask(i), max_tokens=max_tokens,
                                           temperature=0.8, seed=1000 + i, **extra)
        return r.usage.completion_tokens, r.choices[0].finish_reason

    t0 = time.perf_counter()
    results = run_all(one, list(range(n)), n)
    dt = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    return {"requests": n, "output_tokens": tokens, "seconds": round(dt, 2),
            "output_tok_per_s": round(tokens / dt, 2), "requests_per_s": round(n / dt, 3),
            "finish_reasons": _count(f for _, f in results)}


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, out=None, smoke="fewer requests")
    ns = p.parse_args()
    from entrypoints.conftest import RemoteServer

    n_json, n_small, n_tp = (8, 4, 8) if ns.smoke else (50, 20, 64)
    result: dict[str, Any] = {**provenance(), "workload": "structured-outputs",
                              "hardware": cpu_model(), "model": MODEL, "backend": "xgrammar"}
    server = RemoteServer("--structured-outputs-config", '{"backend": "xgrammar"}')
    try:
        import openai

        # A batch of 64 on a busy 2-core machine takes minutes: no client timeout.
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                               max_retries=0, timeout=3600)
        result["json_schema"] = json_schema_figures(client, n_json)
        result["other_constraints"] = regex_choice_tool_figures(client, n_small)
        # The same 64 prompts both ways; the unconstrained run first warms nothing the
        # constrained one needs (its grammar compiles on its first request, in the pool).
        free = throughput(client, n_tp, False, 120)
        constrained = throughput(client, n_tp, True, 120)
        result["throughput"] = {"unconstrained": free, "constrained": constrained,
                                "constrained_over_unconstrained_tok_per_s": round(
                                    constrained["output_tok_per_s"]
                                    / max(free["output_tok_per_s"], 1e-9), 3)}
    finally:
        server.stop()
    write(result, ns.out or default_path("structured-outputs", "cpu", smoke=ns.smoke))
    print(json.dumps({k: v for k, v in result.items() if k != "json_schema"}, indent=2))
    print("json_schema:", {k: v for k, v in result["json_schema"].items()
                           if k not in ("example", "failures")})
    return 0 if result["json_schema"]["valid"] == result["json_schema"]["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
