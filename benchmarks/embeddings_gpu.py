"""Embedding throughput on a GPU (written for one H200): shoal's `LLM.embed` on
all-MiniLM-L6-v2 over N deterministic texts (benchmarks/embedding_texts.py), optionally
against sentence-transformers' `encode` on the same GPU, interleaved round by round after
an untimed warm-up. Writes one JSON list of records (benchmarks/gpu_common.py) to --out.

    PYTHONPATH=. python benchmarks/embeddings_gpu.py --out results/embeddings-H200.json
    PYTHONPATH=. python benchmarks/embeddings_gpu.py --num-texts 50000 --dtype float32 \
        --compare-st --out /tmp/emb.json

shoal runs in bfloat16 by default on CUDA (--dtype float32 for the reference precision);
sentence-transformers runs in float32, or in bfloat16 with --dtype bfloat16 (model.to()).
The vectors of both are compared (cosine per text) when both run."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding_texts import make_texts  # noqa: E402
from gpu_common import record, write  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-texts", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=65536)
    ap.add_argument("--compare-st", action="store_true",
                    help="also time sentence-transformers' encode on the same GPU")
    ap.add_argument("--st-batch-size", type=int, default=256)
    ap.add_argument("--device", default="cuda",
                    help="cuda; cpu only to smoke-test this script (embeddings_cpu.py measures "
                         "the CPU)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="all-MiniLM-L6-v2",
                    help="the embedded model's name, or a folder of its shape (with --load-format "
                         "dummy: its files without the weights)")
    ap.add_argument("--load-format", default="auto")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark is for a GPU (see embeddings_cpu.py)")
        return 1
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    from shoal import LLM

    texts = make_texts(args.num_texts)
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    startup = time.perf_counter() - t0

    def run_shoal() -> np.ndarray:
        return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])

    engines = {"shoal": run_shoal}
    if args.compare_st:
        from sentence_transformers import SentenceTransformer

        from shoal.loader.resolve import MINILM, locate_embedded

        st = SentenceTransformer(str(locate_embedded(MINILM)), device=args.device)
        st.to(getattr(torch, args.dtype))

        def run_st() -> np.ndarray:
            v = st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True,
                          show_progress_bar=False)
            return v.float().cpu().numpy()

        engines["sentence-transformers"] = run_st
    vectors = {name: fn() for name, fn in engines.items()}  # warm-up, untimed
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, fn in engines.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times.items()),
              flush=True)
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
        a, b = vectors["shoal"], vectors["sentence-transformers"]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        records[0]["cosine_vs_st"] = {"min": float(cos.min()), "mean": float(cos.mean())}
        records[0]["speedup_vs_st_median"] = (records[1]["median_s"]
                                              / records[0]["median_s"])
    write(records, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
