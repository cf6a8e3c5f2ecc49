"""Scheduler limits that fit a CPU: how many tokens one step may carry and how many sequences
may run at once, when the user sets neither.

On a GPU a 16k-token step takes well under a second; on a 2-core CPU the same step is a
single 40 s forward pass during which no request gets a token (W4's burst of 64 prompts of
256 tokens: every TTFT 39.7 s, the whole burst at 70 output tok/s). With a budget of a few
hundred tokens per model thread the burst prefills in short chunked steps that also carry
the running decodes: measured with a 256-token budget, the first token after 0.4 s, mean TTFT
16.5 s, and the burst at 91.7 output tok/s (one run per budget on a quiet machine,
benchmarks/results/2026-12-03-cpu-budget-sweep.json; benchmarks/cpu_budget_sweep.py).

That budget is for serving, where a request's first token waits behind each step. Offline,
nobody waits for a first token and big steps are faster: W6 through `LLM` on this 2-core
machine (bf16, 64 requests, same process order) ran at 113 output tok/s with a 512-token
budget, 152 with 4,096 and 173 with 16,384. The offline LLM keeps the large budget."""

from __future__ import annotations

from dataclasses import dataclass

GPU_MAX_NUM_BATCHED_TOKENS = 16384
GPU_MAX_NUM_SEQS = 256
# Tokens per step per model thread: about half a second of SmolLM2-135M prefill per step.
CPU_TOKENS_PER_THREAD = 256
CPU_MIN_NUM_BATCHED_TOKENS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 4096  # vLLM's CPU default for the offline LLM
CPU_MAX_NUM_SEQS = 64  # each decode step's cost grows with the batch


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int


def default_scheduler_limits(device_type: str, threads: int, max_model_len: int,
                             enable_chunked_prefill: bool, *, serving: bool = True,
                             max_num_batched_tokens: int | None = None,
                             max_num_seqs: int | None = None) -> SchedulerLimits:
    """The user's values where given; else the GPU's, or on the CPU when serving a budget
    scaled by the model's threads (offline, the GPU's budget). Without chunked prefill a step must hold a whole prompt, so the default budget
    is then at least max_model_len."""
    if device_type == "cuda":
        budget, seqs = GPU_MAX_NUM_BATCHED_TOKENS, GPU_MAX_NUM_SEQS
    elif not serving:  # offline throughput: large steps (see the module's docstring)
        budget, seqs = GPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS
    else:
        budget = min(max(CPU_TOKENS_PER_THREAD * max(threads, 1), CPU_MIN_NUM_BATCHED_TOKENS),
                     CPU_MAX_NUM_BATCHED_TOKENS)
        seqs = CPU_MAX_NUM_SEQS
    if not enable_chunked_prefill:
        budget = max(budget, max_model_len)
    return SchedulerLimits(
        max_num_batched_tokens=budget if max_num_batched_tokens is None
        else max_num_batched_tokens,
        max_num_seqs=seqs if max_num_seqs is None else max_num_seqs)
