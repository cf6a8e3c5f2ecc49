"""Long-context decode for the staged GPU scripts (hybrid_gpu.py, deepseek_v4_gpu.py): one
request prefilled to each context length, then a few greedy tokens, timed from the engine's
RequestOutput.metrics; each row also holds the bytes the script says a sequence of that
length keeps."""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

import offline_runs


def contexts_for(args: argparse.Namespace, sizes: dict[str, Any]) -> list[int]:
    return list(args.contexts or sizes["contexts"])


def context_max_model_len(args: argparse.Namespace, sizes: dict[str, Any],
                          max_positions: int | None) -> int:
    """--max-model-len or the sizes' own, else the largest context + decode + 128 (capped at
    the model's positions)."""
    if args.max_model_len or sizes["max_model_len"]:
        return int(args.max_model_len or sizes["max_model_len"])
    want = max(contexts_for(args, sizes)) + sizes["decode_tokens"] + 128
    return min(want, max_positions or want)


def timed_request(llm: Any, tokens: int, decode: int, vocab: int, seed: int) -> dict[str, Any]:
    """One request of `tokens` random ids and decode + 1 greedy tokens: TTFT (the prefill,
    chunked) and decode ms a token, from the engine's RequestOutput.metrics."""
    from shoal import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=decode + 1, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate(offline_runs.random_prompt(rng, tokens, vocab), params,
                       use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    n, m = len(out.outputs[0].token_ids), out.metrics
    prefill = decode_ms = None
    if m is not None and m.first_token_time is not None:
        prefill = m.first_token_time - m.arrival_time
        if m.finished_time is not None and n > 1:
            decode_ms = (m.finished_time - m.first_token_time) / (n - 1) * 1000
    return dict(prefill_s=prefill, decode_ms_per_token=decode_ms, decode_tokens=n - 1,
                wall_s=wall, num_cached_tokens=out.num_cached_tokens,
                prefill_tok_s=tokens / prefill if prefill else None)


def measure_contexts(llm: Any, contexts: list[int], limit: int, sizes: dict[str, Any],
                     vocab: int, seed: int, bytes_of: Callable[[int], dict[str, Any]],
                     wont_fit: Callable[[int], str | None] = lambda tokens: None
                     ) -> list[dict[str, Any]]:
    """A warm-up request, then one row per context: `bytes_of(context)`, and the timings
    where the request fits: contexts over `limit` tokens, or that `wont_fit` (given the
    request's whole length) says why not, get bytes only."""
    decode = sizes["decode_tokens"]
    timed_request(llm, min(64, limit - decode - 1), 4, vocab, seed)  # warm-up
    rows = []
    for i, c in enumerate(contexts):
        row: dict[str, Any] = dict(context=c, **bytes_of(c))
        if c + decode + 1 > limit:
            row["skipped"] = f"context + {decode + 1} tokens over max_model_len {limit}"
        elif why := wont_fit(c + decode + 1):
            row["skipped"] = why
        else:
            row |= timed_request(llm, c, decode, vocab, seed + 1 + i)
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
    return rows
