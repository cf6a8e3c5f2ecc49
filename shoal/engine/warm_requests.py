"""Requests run end to end before a GPU engine reports ready (engine/core.py)."""

from __future__ import annotations

import time
from typing import Any

from shoal.core.types import EngineCoreRequest


def warm_request_path(core: Any) -> None:
    """Runs requests end to end through the scheduler, the runner and the sampler before
    the engine reports ready, so real traffic finds every kernel loaded: a greedy one, a
    sampled one with top-p/top-k and logprobs, then a full batch (max_num_seqs, as far as
    the pool allows) of sampled ones, as the first busy batch will be. Then forgets them."""
    from shoal.sampling_params import SamplingParams

    prompt = [i % core.vocab_size for i in range(1, 40)]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=3,
                             ignore_eos=True, logprobs=2, seed=0)]
    batch = min(core.limits.max_num_seqs, core.limits.num_kv_blocks // 4)
    params += [SamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True)] * batch
    for i, sp in enumerate(params):
        core.add_request(EngineCoreRequest(f"__warmup_{i}", prompt[:8 + i % 31], sp,
                                           time.monotonic()))
        if i == 1:  # the two single requests first, alone
            core.run_until_idle()
    core.run_until_idle()
    core.scheduler.kv.reset_prefix_cache()
    core.scheduler.reset_counters()
