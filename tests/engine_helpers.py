"""Helpers for tests that drive the whole engine on the tiny random checkpoint
(`tiny_llama_dir` in conftest.py): a small-block engine, random prompts, and the check that a
finished engine holds no blocks, and NaN logits injected into one request's sampling rows."""

from __future__ import annotations

import random

from shoal import LLM


def tiny_llm(path, **kw) -> LLM:
    """An engine in float32 with blocks of 4 tokens, so short prompts span many blocks."""
    args = dict(dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=512)
    args.update(kw)
    return LLM(model=str(path), **args)


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 60) -> list[dict]:
    """n token-id prompts of lo to hi-1 tokens, inside the tiny checkpoint's vocabulary."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))]}
            for _ in range(n)]


def blocks_all_free(llm: LLM) -> bool:
    """Every block back in the pool, no request left in the scheduler or the runner, and no
    step in flight."""
    core = llm.llm_engine.core
    pool = core.scheduler.kv.pool
    runner = getattr(core.runner, "driver", core.runner)  # rank 0 of a parallel executor
    return (pool.num_free_blocks == pool.num_blocks and not core.scheduler.requests
            and all(b.ref_cnt == 0 for b in pool.blocks) and not runner.requests
            and not core.queue)


def nan_logits_for(runner, request_id: str, times: int | None = None) -> list[int]:
    """Gives `request_id`'s sampling rows NaN logits: every one, or the next `times` (until
    `del runner.sample`); returns the list of rows hit, one entry per injection."""
    import torch

    real = runner.sample
    hits: list[int] = []

    @torch.inference_mode()  # as the runner's own sample (the logits are inference tensors)
    def sample(handle, grammar):
        if handle.inputs is not None:
            logits = handle.forward.wait().logits
            for i, it in enumerate(it for it in handle.inputs.items if it.sample):
                if it.request_id == request_id and (times is None or len(hits) < times):
                    logits[i] = float("nan")
                    hits.append(i)
        return real(handle, grammar)

    runner.sample = sample
    return hits
