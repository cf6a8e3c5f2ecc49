"""Reliability figures on this CPU (issue 18): hostile requests, schema-generated requests,
disconnect storms, an overload burst, the fault tests and the GGUF fuzzers, in one run.

    .venv/bin/python benchmarks/reliability_cpu.py            # the full run (~15 min here)
    .venv/bin/python benchmarks/reliability_cpu.py --smoke    # a quick check

Hostile requests (tests/reliability/hostile_cases.py) go to a real `shoal serve` (SmolLM2 on
the CPU); each answer is counted 2xx / 4xx / 5xx / no answer, and the server must still be
alive and answer a normal request as it did before. Schema fuzzing (schemathesis, valid and
schema-breaking requests for every operation) and the load tests run against the real
frontend over the model-free null engine (tests/reliability/null_server.py); the real model
also gets a smaller disconnect storm, after which its KV usage must be 0. Fault cases are the
tests that kill, poison or interrupt the engine, run by pytest; each passing test is a fault
survived. Results: benchmarks/results/<date>-reliability-cpu.json."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path[:0] = [str(TESTS / "reliability"), str(TESTS), str(ROOT / "benchmarks")]
from bench_args import add_common  # noqa: E402
from results_file import cpu_model, default_path, provenance, write  # noqa: E402
from server_process import SHOAL_CLI, ServerProcess, free_port  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAULT_TESTS = {
    "engine process killed (SIGKILL) while serving": "tests/entrypoints/test_server_lifecycle.py"
    "::test_engine_death_fails_requests_and_exits_nonzero",
    "exception in one request, sync and async": "tests/reliability/test_engine_faults.py"
    "::test_an_exception_in_one_request_fails_only_that_request",
    "exception in a request alone": "tests/reliability/test_engine_faults.py"
    "::test_a_request_alone_in_a_failing_step_fails_at_once",
    "NaN logits": "tests/reliability/test_engine_faults.py"
    "::test_nan_logits_fail_the_request_and_publish_no_kv_blocks",
    "NaN logits + preemption with a step in flight": "tests/reliability/test_review_findings.py"
    "::test_nan_plus_preemption_never_zeroes_blocks_of_another_request",
    "request id reused with a step in flight": "tests/reliability/test_review_findings.py"
    "::test_request_id_reused_while_its_old_step_is_in_flight",
    "SIGTERM inside a step": "tests/reliability/test_engine_signals.py",
    "disk tier: SIGKILL mid-write": "tests/kv_offload/test_disk_crash_safety.py"
    "::test_sigkill_in_the_middle_of_a_block_write",
    "disk tier: engine killed while persisting": "tests/kv_offload/test_disk_crash_safety.py"
    "::test_engine_killed_while_persisting_restarts_with_the_same_tokens",
    "disk tier: full disk": "tests/kv_offload/test_disk_crash_safety.py"
    "::test_a_full_disk_fails_writes_cleanly",
    "disk tier: engine on a full disk": "tests/kv_offload/test_disk_crash_safety.py"
    "::test_engine_on_a_full_disk_restarts_with_the_same_tokens",
    "CPU tier persisted when dropped / at interpreter exit":
        "tests/kv_offload/test_disk_crash_safety.py"
        "::test_cpu_tier_reaches_the_disk_when_dropped_or_at_interpreter_exit",
    "request past request_timeout": "tests/reliability/test_request_limits.py"
    "::test_a_request_past_request_timeout_ends_with_an_error",
}


def start_server() -> ServerProcess:
    """`shoal serve` on the embedded SmolLM2 with the test suite's arguments."""
    from entrypoints.conftest import BASE_ARGS

    port = free_port()
    cmd = [sys.executable, *SHOAL_CLI, "serve", "--port", str(port), *BASE_ARGS]
    log = Path(tempfile.mkstemp(prefix="shoal-rel-", suffix=".log")[1])
    return ServerProcess(cmd, port, cwd=ROOT, log=log, poll_s=0.5)


# ---- the measurements ------------------------------------------------------------------------
NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def hostile(server: ServerProcess) -> dict[str, Any]:
    from hostile_cases import hostile_cases
    from test_hostile_requests import is_openai_error, send

    before = httpx.post(server.url + "/v1/completions", json=NORMAL, timeout=120).json()
    counts = {"sent": 0, "2xx": 0, "4xx": 0, "5xx": 0, "no_answer": 0,
              "4xx_without_openai_body": 0}
    not_4xx: list[str] = []
    for case in hostile_cases():
        counts["sent"] += 1
        try:
            resp = send(server.url, case)
        except httpx.HTTPError as e:
            counts["no_answer"] += 1
            not_4xx.append(f"{case.name}: {type(e).__name__}")
            continue
        cls = f"{resp.status_code // 100}xx"
        counts[cls] = counts.get(cls, 0) + 1
        if cls != "4xx":
            not_4xx.append(f"{case.name}: {resp.status_code} {resp.text[:150]}")
        elif not is_openai_error(resp):
            counts["4xx_without_openai_body"] += 1
    after = httpx.post(server.url + "/v1/completions", json=NORMAL, timeout=120).json()
    same = before["choices"][0]["text"] == after["choices"][0]["text"]
    return {**counts, "not_4xx": not_4xx, "server_alive": server.alive(),
            "normal_answer_unchanged": same}


def storm_figures(base_url: str, port: int, clients: int, hang_up_fraction: float,
                  max_tokens: int, seed: int) -> dict[str, Any]:
    from server_checks import wait_idle
    from storm import storm

    t0 = time.perf_counter()
    results = asyncio.run(storm("127.0.0.1", port, clients, hang_up_fraction, max_tokens, seed))
    wall = time.perf_counter() - t0
    kept = [r for r in results if r.hang_up_after is None]
    hung = [r for r in results if r.hang_up_after is not None]
    complete = [r for r in kept if r.status == 200 and r.done and r.error is None
                and r.completion_tokens == max_tokens]
    idle = wait_idle(base_url)
    return {"clients": clients, "hung_up": len(hung), "kept": len(kept),
            "kept_completed": len(complete), "kept_failed": len(kept) - len(complete),
            "max_tokens": max_tokens, "wall_s": round(wall, 2),
            "after": {k.split(":")[1]: v for k, v in idle.items()},
            "leaked_requests": idle.get("shoal:num_requests_running", -1)
            + idle.get("shoal:num_requests_waiting", -1),
            "kv_cache_usage_after": idle.get("shoal:kv_cache_usage_perc")}


def burst_figures() -> dict[str, Any]:
    """The overload burst against a null server of its own, slow enough that no request
    finishes while the burst arrives (tests/reliability/null_server.py: OVERLOAD_SERVER)."""
    from null_server import (
        OVERLOAD_MAX_SEQS,
        OVERLOAD_MAX_WAITING,
        OVERLOAD_SERVER,
        NullServer,
        burst,
    )

    n = 2 * (OVERLOAD_MAX_SEQS + OVERLOAD_MAX_WAITING)
    srv = NullServer(**OVERLOAD_SERVER)
    try:
        by_status = burst(srv.base_url, n)
    finally:
        srv.stop()
    ok, busy = by_status.get(200, []), by_status.get(503, [])
    return {"server": f"null engine, 50 ms steps, max_num_seqs {OVERLOAD_MAX_SEQS}, "
                      f"max_waiting_requests {OVERLOAD_MAX_WAITING}",
            "requests": n, "200": len(ok), "503": len(busy),
            "other": n - len(ok) - len(busy),
            "503_with_retry_after": sum("retry-after" in r.headers for r in busy),
            "200_complete": sum(r.json()["usage"]["completion_tokens"] == 20 for r in ok)}


def null_server_figures(smoke: bool) -> dict[str, Any]:
    from null_server import NULL_MAX_SEQS, NULL_MAX_WAITING, NullServer
    from schema_fuzz import fuzz

    srv = NullServer(step_ms=1, max_num_seqs=NULL_MAX_SEQS, max_waiting=NULL_MAX_WAITING,
                     max_model_len=128)
    try:
        t0 = time.perf_counter()
        fz = fuzz(srv.base_url, examples_per_operation=10 if smoke else 150, seed=None)
        schema = {"cases": fz.cases, "by_class": dict(fz.by_class),
                  "server_errors": fz.server_errors[:20],
                  "wall_s": round(time.perf_counter() - t0, 1)}
        storm = storm_figures(srv.base_url, srv.port, 100 if smoke else 300, 0.3, 32, 7)
    finally:
        srv.stop()
    return {"server": f"null engine, max_num_seqs {NULL_MAX_SEQS}, max_waiting_requests "
                      f"{NULL_MAX_WAITING}", "schemathesis": schema,
            "disconnect_storm": storm, "overload_burst": burst_figures()}


def fault_figures() -> dict[str, Any]:
    xml = Path(tempfile.mkstemp(suffix=".xml")[1])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *FAULT_TESTS.values()]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    import xml.etree.ElementTree as ET

    cases = ET.parse(xml).getroot().iter("testcase")
    outcome: dict[str, str] = {}
    for c in cases:
        ok = not any(child.tag in ("failure", "error") for child in c)
        outcome[f"{c.get('classname')}::{c.get('name')}"] = "survived" if ok else "FAILED"
    return {"cases": outcome, "survived": sum(v == "survived" for v in outcome.values()),
            "total": len(outcome), "pytest_exit_code": proc.returncode}


def gguf_figures(smoke: bool) -> list[dict[str, Any]]:
    runs = ["--mutations", "200" if smoke else "3000", "--atheris-runs",
            "500" if smoke else "20000"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/fuzz_gguf.py"), *runs],
                          cwd=ROOT, capture_output=True, text=True)
    return json.loads(proc.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, out=None, smoke="fewer cases, runs and clients")
    ns = p.parse_args()
    result: dict[str, Any] = {**provenance(), "workload": "reliability",
                              "hardware": cpu_model(), "wiring": "in the source"}
    server = start_server()
    try:
        result["hostile_requests"] = hostile(server)
        result["real_model_disconnect_storm"] = storm_figures(
            server.url, server.port, 12 if ns.smoke else 32, 0.5, 12, 3)
        result["real_model_server_alive"] = server.alive()
    finally:
        server.stop()
    result["null_engine"] = null_server_figures(ns.smoke)
    result["faults"] = fault_figures()
    result["gguf_fuzz"] = gguf_figures(ns.smoke)
    print(json.dumps(result, indent=2))
    write(result, ns.out or default_path("reliability", "cpu", smoke=ns.smoke))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
