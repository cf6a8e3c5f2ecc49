"""Speculative decoding figures of an engine over a set of prompts (eagle3_train_head.py):
output tok/s, and from the engine's spec_decode counters (SchedulerStats, vLLM's names) the
mean acceptance length and the acceptance rate by draft position; plus loading an EAGLE-3
checkpoint into a running engine's head (a load_format="dummy" engine builds its head with
random weights and never reads the folder's)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import torch

from shoal import SamplingParams
from shoal.spec_decode.eagle3 import renamed_eagle3
from shoal.spec_decode.eagle_head import read_eagle_tensors


class SpecCounters:
    """Sums the spec_decode counters of every SchedulerStats the engine core makes (each
    covers the steps since the one before)."""

    FIELDS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
    PER_POS = ("spec_num_accepted_tokens_per_pos", "spec_num_verified_tokens_per_pos",
               "spec_num_proposed_tokens_per_pos")

    def __init__(self, llm: Any):
        scheduler = engine_internals.core(llm, required=True).scheduler
        self.totals: dict[str, Any] = {}
        self.reset()
        stats = scheduler.stats

        def counted() -> Any:
            s = stats()
            for name in self.FIELDS:
                self.totals[name] += getattr(s, name)
            for name in self.PER_POS:
                for i, n in enumerate(getattr(s, name) or []):
                    per = self.totals[name]
                    per.extend([0] * (i + 1 - len(per)))
                    per[i] += n
            return s
        scheduler.stats = counted

    def reset(self) -> None:
        self.totals = {**{n: 0 for n in self.FIELDS}, **{n: [] for n in self.PER_POS}}

    def figures(self) -> dict[str, Any]:
        """mean_acceptance_length = 1 + accepted / drafts (vLLM's); acceptance_rate_per_pos
        [i] = drafts whose position i was accepted / drafts (vLLM's per-position rate);
        conditional_acceptance_per_pos[i] = accepted at i / verified at i (the adaptive
        budget may verify fewer than k)."""
        t = self.totals
        drafts, accepted = t["spec_num_drafts"], t["spec_num_accepted_tokens"]
        acc, ver = t["spec_num_accepted_tokens_per_pos"], t["spec_num_verified_tokens_per_pos"]
        out = {"num_drafts": drafts, "num_draft_tokens": t["spec_num_draft_tokens"],
               "num_accepted_tokens": accepted, "accepted_per_pos": list(acc),
               "verified_per_pos": list(ver),
               "proposed_per_pos": list(t["spec_num_proposed_tokens_per_pos"])}
        if drafts:
            out.update(
                mean_acceptance_length=round(1 + accepted / drafts, 3),
                draft_acceptance_rate=round(accepted / max(1, t["spec_num_draft_tokens"]), 3),
                acceptance_rate_per_pos=[round(a / drafts, 3) for a in acc],
                conditional_acceptance_per_pos=[round(a / v, 3) if v else None
                                                for a, v in zip(acc, ver)])
        return out


def run_prompts(llm: Any, counters: SpecCounters | None, prompts: list[dict], max_tokens: int,
                batched: bool, ignore_eos: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy: all prompts in one generate (batched), else one at a time. Figures and the
    output token ids."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if counters is not None:
        counters.reset()
    offline_runs.sync()
    t0 = time.perf_counter()
    if batched:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    offline_runs.sync()
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    fig: dict[str, Any] = {"wall_s": round(wall, 3), "output_tokens": n,
                           "output_tok_s": round(n / wall, 2)}
    if counters is not None:
        fig.update(counters.figures())
    return fig, tokens


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict[str, int] | None:
    """Where two sets of outputs first differ (request, token), None when identical."""
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return {"request": r, "token": i}
    return None if len(a) == len(b) else {"request": min(len(a), len(b)), "token": 0}


@torch.no_grad()
def load_head_in_place(llm: Any, folder: Path) -> None:
    """The EAGLE-3 checkpoint in `folder` into the running engine's head, in place (the
    drafter's CUDA graphs read the same storage)."""
    runner = engine_internals.runner(llm)
    head = getattr(getattr(runner, "drafter", None), "model", None)
    if head is None or not hasattr(head, "load_weights"):
        raise RuntimeError("load_head_in_place: the engine has no EAGLE-3 head to load into")
    head.load_weights(renamed_eagle3(read_eagle_tensors(folder)), runner.model)
