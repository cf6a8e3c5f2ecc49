"""Tensor parallelism through the engine (shoal/executor/multiproc.py): LLM with
tensor_parallel_size=2 on the CPU (two processes joined by gloo) generates what one rank does,
for greedy and seeded sampling, and refuses what it does not support with a clear error."""

from __future__ import annotations

import pytest
import torch
from executor.worker_checks import served_tokens

from shoal import LLM, SamplingParams
from shoal.engine.engine_args import EngineArgs

PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9]]


def _generate(path: str, tp: int, *params: SamplingParams,
              backend: str | None = None) -> list[list[list[int]]]:
    """Each of `params` over PROMPTS on one engine (an engine start is most of a test's
    time): the token ids of every prompt, for each of them."""
    llm = LLM(model=path, tensor_parallel_size=tp, device="cpu", dtype="float32",
              max_model_len=128, kv_cache_memory_bytes=2**22, enable_prefix_caching=False,
              distributed_executor_backend=backend)
    try:
        runner = llm.llm_engine.core.runner
        if backend == "mp" or tp > 1:  # really split: rank 0 holds 1/tp of the heads
            assert type(runner).__name__ == "MultiprocExecutor" and runner.world == tp
            assert all(p.is_alive() for p in runner._procs) and len(runner._procs) == tp - 1
            full = runner.driver.hf_config.num_attention_heads
            assert runner.driver.model.attention_layers()[0].num_heads * tp == full
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        return [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
                for sp in params]
    finally:
        llm.shutdown()


def test_two_ranks_generate_what_one_rank_does(tiny_llama_dir):
    torch.set_num_threads(1)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    one = _generate(str(tiny_llama_dir), 1, greedy, seeded)
    assert _generate(str(tiny_llama_dir), 2, greedy, seeded) == one
    # The mp executor at world size 1 (a process group of one, no worker processes).
    assert _generate(str(tiny_llama_dir), 1, greedy, backend="mp") == one[:1]


def test_worker_ranks_build_the_model_hf_overrides_made(tiny_llama_dir):
    """--hf-overrides reach every rank: a norm epsilon that changes the tokens gives two
    ranks one rank's tokens (a rank 1 without it would add other partial sums)."""
    torch.set_num_threads(1)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def tokens(tp: int, overrides: str | None) -> list[list[int]]:
        llm = LLM(model=str(tiny_llama_dir), tensor_parallel_size=tp, device="cpu",
                  dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22,
                  hf_overrides=overrides)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        finally:
            llm.shutdown()

    wide_eps = '{"rms_norm_eps": 4.0}'
    one = tokens(1, wide_eps)
    assert one != tokens(1, None)  # the override changes the model
    assert tokens(2, wide_eps) == one


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
    ({"tensor_parallel_size": 2, "async_scheduling": True}, "async_scheduling does not support"),
    ({"tensor_parallel_size": 2, "kv_offloading_size": 1.0}, "kv_offloading_size does not"),
    ({"distributed_executor_backend": "threads"}, "must be one of uni, mp"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "needs 'mp'"),
])
def test_unsupported_tensor_parallel_settings_are_refused(kwargs, message):
    class Hf:
        vocab_size = 512
        max_position_embeddings = 128

    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", **kwargs).create_engine_config(Hf())


def test_serve_with_two_ranks_answers_like_one(tiny_llama_dir):
    """`shoal serve --tensor-parallel-size 2`: the engine core process starts the worker
    rank; the official client's greedy completion equals the single-rank engine's."""
    expected = _generate(str(tiny_llama_dir), 1,
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0]
    assert served_tokens(str(tiny_llama_dir), ["--tensor-parallel-size", "2"],
                         PROMPTS[0]) == expected


_ORPHAN_SCRIPT = """
import sys, time
from shoal import LLM
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32",
          max_model_len=128, kv_cache_memory_bytes=2**22)
print(" ".join(str(p.pid) for p in llm.llm_engine.core.runner._procs), flush=True)
time.sleep(600)
"""


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (this container's init may not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except (FileNotFoundError, ProcessLookupError):  # (gone between the open and the read)
        return True


def test_worker_ranks_exit_when_the_engine_is_killed(tiny_llama_dir):
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny_llama_dir)],
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and not _exited(pids[0])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while not _exited(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _exited(pids[0]), "the worker rank outlived its engine"
    finally:
        if proc.poll() is None:
            proc.kill()
