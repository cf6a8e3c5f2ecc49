"""What the GPU weight tests compare (test_weight_offload_gpu.py, test_weight_copies_gpu.py):
each prompt's greedy tokens and its top logprobs, and a comparison that takes the tokens
exactly and the logprobs to bfloat16's rounding."""

from __future__ import annotations

import torch

from shoal import LLM, SamplingParams


def greedy_outputs(llm: LLM, prompts: list[dict], params: SamplingParams
                   ) -> list[tuple[list[int], list[list[float]]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [sorted(lp.logprob for lp in d.values()) for d in o.outputs[0].logprobs])
            for o in outs]


def same(a: list, b: list) -> bool:
    """Tokens exactly, logprobs to bfloat16's rounding."""
    return all(ta == tb and torch.allclose(torch.tensor(la), torch.tensor(lb), atol=2e-2)
               for (ta, la), (tb, lb) in zip(a, b))
