"""Fuzz the GGUF loading path (header, config, tokenizer, tensor plan, dequantized weights):
every malformed file must raise ValueError, never anything else, hang or allocate much.

    .venv/bin/python benchmarks/fuzz_gguf.py --mutations 5000          # structure-aware
    .venv/bin/python benchmarks/fuzz_gguf.py --atheris-runs 20000      # coverage-guided

The structure-aware mutator (tests/reliability/gguf_mutations.py) targets every length,
count, type code and dimension of a valid file's header; atheris (libFuzzer) mutates bytes
with coverage feedback from the gguf package and shoal.loader, with libFuzzer's own -timeout
and -rss_limit_mb catching hangs and huge allocations. Prints a JSON summary."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests" / "loader"),
                str(ROOT / "tests")]
from bench_args import add_common  # noqa: E402
from results_file import provenance, write  # noqa: E402


def run_mutations(n: int, seed: int) -> dict:
    from gguf_mutations import header_slots, load_everything, mutate, write_seed

    work = Path(tempfile.mkdtemp(prefix="shoal-fuzz-"))
    base = write_seed(work / "seed.gguf")
    data, slots = base.read_bytes(), header_slots(base)
    load_everything(base)  # imports and first-use costs stay out of the per-file times
    rng, case = random.Random(seed), work / "case.gguf"
    outcomes: Counter = Counter()
    escaped: list[str] = []
    worst_s = worst_peak = 0.0
    tracemalloc.start()
    t0 = time.perf_counter()
    for i in range(n):
        case.write_bytes(mutate(data, slots, rng))
        tracemalloc.reset_peak()
        t = time.perf_counter()
        try:
            load_everything(case)
            outcomes["loaded"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
        except Exception as e:
            outcomes[type(e).__name__] += 1
            escaped.append(f"case {i}: {type(e).__name__}: {str(e)[:200]}")
        worst_s = max(worst_s, time.perf_counter() - t)
        worst_peak = max(worst_peak, tracemalloc.get_traced_memory()[1])
    return {"mode": "structure-aware mutations", "files": n, "seed": seed,
            "outcomes": dict(outcomes), "other_exceptions": escaped[:20],
            "slowest_file_s": round(worst_s, 3), "largest_peak_alloc_mib":
            round(worst_peak / 2**20, 1), "wall_s": round(time.perf_counter() - t0, 1)}


def atheris_main() -> None:
    """Child process: the libFuzzer loop (arguments after --atheris-child go to libFuzzer)."""
    import atheris
    import numpy  # noqa: F401 - the heavy libraries are not instrumented
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    with atheris.instrument_imports(include=["gguf", "shoal.loader"]):
        import gguf  # noqa: F401

        import shoal.loader.gguf_config  # noqa: F401
        import shoal.loader.gguf_file  # noqa: F401
        import shoal.loader.gguf_loader  # noqa: F401
        import shoal.loader.gguf_tokenizer  # noqa: F401
    from gguf_mutations import load_everything
    case = Path(tempfile.mkdtemp(prefix="shoal-atheris-")) / "case.gguf"

    def one(data: bytes) -> None:
        case.write_bytes(data)
        try:
            load_everything(case)
        except ValueError:
            pass

    atheris.Setup([sys.argv[0], *sys.argv[2:]], one)
    atheris.Fuzz()


def run_atheris(runs: int, timeout_s: int, rss_mb: int) -> dict:
    from gguf_mutations import write_seed

    corpus = Path(tempfile.mkdtemp(prefix="shoal-corpus-"))
    write_seed(corpus / "seed.gguf")
    cmd = [sys.executable, __file__, "--atheris-child", f"-runs={runs}",
           f"-timeout={timeout_s}", f"-rss_limit_mb={rss_mb}", "-max_len=65536",
           "-print_final_stats=1", str(corpus)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:3])})
    tail = (proc.stdout + proc.stderr)[-3000:]
    stats = dict(ln[len("stat::"):].split(":", 1) for ln in tail.splitlines()
                 if ln.startswith("stat::"))
    stats = {k.strip(): v.strip() for k, v in stats.items()}
    return {"mode": "atheris (libFuzzer)", "runs": runs, "exit_code": proc.returncode,
            "crashed": proc.returncode != 0, "timeout_s": timeout_s, "rss_limit_mb": rss_mb,
            "stats": stats, "wall_s": round(time.perf_counter() - t0, 1),
            "log_tail": tail[-1500:] if proc.returncode else ""}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--atheris-child":
        atheris_main()
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutations", type=int, default=0)
    p.add_argument("--atheris-runs", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=int, default=10)
    p.add_argument("--rss-limit-mb", type=int, default=4096)
    add_common(p, out=None)
    ns = p.parse_args()
    out = []
    if ns.mutations:
        out.append(run_mutations(ns.mutations, ns.seed))
    if ns.atheris_runs:
        out.append(run_atheris(ns.atheris_runs, ns.timeout_s, ns.rss_limit_mb))
    print(json.dumps(out, indent=2))
    if ns.out:
        write({**provenance(), "workload": "gguf-fuzz", "runs": out}, ns.out)
    return 0 if all(not r.get("crashed") and not r.get("other_exceptions") for r in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
