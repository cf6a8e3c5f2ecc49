"""Greedy agreement with transformers, for the staged GPU scripts' correctness parts
(hybrid_gpu.py, deepseek_v4_gpu.py): a transformers model built at the real width with random
weights, saved, loaded by shoal; both decode the same random prompts greedily.

Random weights keep the tiny test checkpoints' gain at any width (tests/oracle.py draws
matrices N(0, 0.2) at hidden 64; unscaled, that blows up at real widths). Logprobs are
compared over each prompt's agreeing prefix only (after a divergence the contexts differ), and
transformers' own margin at the first divergence tells a near-tie from a wrong token."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from staged_gpu import free_memory

INIT_RULE = "matrices N(0, 0.2 * min(1, sqrt(64 / fan_in))), vectors U(0.5, 1.5)"
# oracle(hf, prompt, steps, device) -> transformers' greedy tokens and their logprob rows
Oracle = Callable[[Any, list[int], int, str], tuple[list[int], list[Any]]]


def randomize(model: Any, by_suffix: dict[str, Callable[[Any], Any]] | None = None) -> None:
    """INIT_RULE's draw in place; a parameter whose name ends with a key of `by_suffix` gets
    that draw instead."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = next((f for s, f in (by_suffix or {}).items() if name.endswith(s)), None)
            if draw is not None:
                draw(p)
            elif p.dim() > 1:
                p.normal_(0, 0.2 * min(1.0, math.sqrt(64 / p.shape[-1])))
            else:
                p.uniform_(0.5, 1.5)


def correctness_device(smoke: bool) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and not smoke else "cpu"


@dataclass
class HfAndShoal:
    hf: Any  # the transformers model
    llm: Any  # shoal's LLM on its saved checkpoint
    build_save_s: float  # transformers built, randomized and saved
    shoal_ready_s: float


@contextmanager
def hf_and_shoal(build: Callable[[Any], Any], draw: Callable[[Any], None],
                 sizes: dict[str, Any], device: str, seed: int, prefix: str
                 ) -> Iterator[HfAndShoal]:
    """build(dtype) on `device` (seeded), `draw` over its weights, save_pretrained to a temp
    folder, shoal's LLM on it (sizes corr_max_model_len, corr_kv_bytes); all freed after."""
    import torch

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        hf = build(getattr(torch, sizes["dtype"])).eval()
    draw(hf)
    tmp = tempfile.mkdtemp(prefix=prefix)
    pair = None
    try:
        hf.save_pretrained(tmp)
        build_s = time.perf_counter() - t0
        print(f"[correctness] transformers built and saved in {build_s:.1f} s", file=sys.stderr,
              flush=True)
        t1 = time.perf_counter()
        llm = shoal_llm(tmp, sizes, device)
        ready_s = time.perf_counter() - t1
        print(f"[correctness] shoal ready in {ready_s:.1f} s", file=sys.stderr, flush=True)
        pair = HfAndShoal(hf, llm, build_s, ready_s)
        yield pair
    finally:
        if pair is not None:
            pair.llm.shutdown()
            pair.hf = pair.llm = None
        del hf
        shutil.rmtree(tmp, ignore_errors=True)
        free_memory()


def shoal_llm(folder: str, sizes: dict[str, Any], device: str) -> Any:
    from shoal import LLM

    kw: dict[str, Any] = dict(dtype=sizes["dtype"], max_model_len=sizes["corr_max_model_len"],
                              max_num_seqs=8, kv_cache_memory_bytes=sizes["corr_kv_bytes"])
    if device == "cpu":
        kw["device"] = "cpu"
    return LLM(model=folder, **kw)


def compare(llm: Any, hf: Any, prompts: list[list[int]], steps: int, device: str,
            oracle: Oracle) -> dict[str, Any]:
    """shoal's greedy tokens (all prompts in one generate) against oracle's, prompt by
    prompt: token agreement, the largest |logprob difference| over the agreeing prefix, the
    first divergence step and transformers' margin there."""
    from shoal import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    shoal_s = time.perf_counter() - t0
    print(f"[correctness] shoal generated in {shoal_s:.1f} s", file=sys.stderr, flush=True)
    same = total = 0
    rows = []
    t1 = time.perf_counter()
    for p, o in zip(prompts, outs):
        ref, ref_lp = oracle(hf, p, steps, device)
        got = list(o.outputs[0].token_ids)
        agree = [a == b for a, b in zip(got, ref)]
        same, total = same + sum(agree), total + steps
        div = next((i for i, a in enumerate(agree) if not a), None)
        diffs = [abs(o.outputs[0].logprobs[i][got[i]].logprob - ref_lp[i][got[i]].item())
                 for i in range(steps if div is None else div)]
        rows.append(dict(prompt_len=len(p), first_divergence_step=div,
                         max_logprob_diff=max(diffs, default=None),
                         hf_margin_at_divergence=None if div is None else
                         (ref_lp[div][ref[div]] - ref_lp[div][got[div]]).item()))
    hf_s = time.perf_counter() - t1
    print(f"[correctness] transformers greedy in {hf_s:.1f} s", file=sys.stderr, flush=True)
    divs = [r["first_divergence_step"] for r in rows if r["first_divergence_step"] is not None]
    lp = [r["max_logprob_diff"] for r in rows if r["max_logprob_diff"] is not None]
    return dict(prompts=len(prompts), steps=steps, token_match_fraction=same / total,
                prompts_identical=sum(r["first_divergence_step"] is None for r in rows),
                first_divergence_step=min(divs) if divs else None,
                max_logprob_diff=max(lp) if lp else None, shoal_generate_s=shoal_s,
                hf_greedy_s=hf_s, per_prompt=rows,
                logprob_rule="over each prompt's agreeing prefix")
