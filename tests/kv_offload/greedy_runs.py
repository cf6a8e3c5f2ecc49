"""What the tier tests of models with several cache groups share: random prompts, and one
greedy request's cached-token count, tokens and logprobs (a tier hit must give a miss's)."""

from __future__ import annotations

import random

from shoal import LLM, SamplingParams

GREEDY_6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def random_prompt(seed: int, n: int, hi: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, hi) for _ in range(n)]


def greedy_run(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY_6
               ) -> tuple[int, list[int], list[float]]:
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    c = out.outputs[0]
    return (out.num_cached_tokens, c.token_ids,
            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
