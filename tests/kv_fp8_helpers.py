"""Comparing a kv_cache_dtype="fp8" greedy run with the same engine's "auto" run: the same
tokens up to a near tie of the auto run (reduced_precision.py's helper, with FP8's own
margin), and how far each compared token's logprob moved.

The runs' raw logits are recorded from the runner's sampling step (as engine_helpers'
nan_logits_for reaches them), one row per generated token of each request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from reduced_precision import assert_greedy_matches_up_to_a_near_tie

from shoal import LLM, SamplingParams


@dataclass
class GreedyRun:
    tokens: list[list[int]]  # per prompt
    logits: list[list[torch.Tensor]]  # per prompt, per generated token: the step's logits


def greedy_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> GreedyRun:
    core = llm.llm_engine.core
    runner = getattr(core.runner, "driver", core.runner)
    real = runner.sample
    rows: dict[str, list[torch.Tensor]] = {}

    @torch.inference_mode()  # as the runner's own sample (the logits are inference tensors)
    def sample(handle, grammar):
        if handle.inputs is not None:
            logits = handle.forward.wait().logits
            for i, it in enumerate(it for it in handle.inputs.items if it.sample):
                rows.setdefault(it.request_id, []).append(logits[i].float().clone())
        return real(handle, grammar)

    runner.sample = sample
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del runner.sample
    return GreedyRun([o.outputs[0].token_ids for o in outs], [rows[o.request_id] for o in outs])


@dataclass
class Comparison:
    mean_abs_logprob_diff: float
    compared: int  # tokens compared
    agreeing: list[int]  # per prompt: leading tokens equal to the auto run's

    def describe(self) -> str:
        return (f"mean |logprob(fp8) - logprob(auto)| {self.mean_abs_logprob_diff:.4f} over "
                f"{self.compared} tokens; leading tokens equal per prompt {self.agreeing}")


def compare_with_auto(fp8: GreedyRun, auto: GreedyRun, rel_margin: float) -> Comparison:
    """Asserts each prompt's FP8 tokens follow the auto run's up to a near tie (the chosen
    token's auto logit within rel_margin x the row's largest |logit| of the auto top), then
    compares the logprob of the auto run's token at every step both runs share the context
    of: each step up to and including the first divergence."""
    diffs, agreeing = [], []
    for got, ref, ref_logits, logits in zip(fp8.tokens, auto.tokens, auto.logits, fp8.logits):
        n = assert_greedy_matches_up_to_a_near_tie(got, ref, ref_logits, rel_margin)
        agreeing.append(n)
        for i in range(min(n + 1, len(ref))):
            a = torch.log_softmax(ref_logits[i], -1)[ref[i]]
            b = torch.log_softmax(logits[i], -1)[ref[i]]
            diffs.append(float((a - b).abs()))
    return Comparison(sum(diffs) / len(diffs), len(diffs), agreeing)
