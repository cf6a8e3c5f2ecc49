"""Tensor and pipeline parallelism over Ray actors (shoal/executor/ray_executor.py) on the
CPU: on a local Ray cluster, the embedded SmolLM2 split over three ranks (its 9 heads do not
split in two: the driver and two actors, joined by gloo) generates what one rank does, and so
do tiny Llamas over two pipeline stages (with micro-batches in flight, an uneven layer split,
and two TP ranks per stage); a killed actor fails the requests in flight within seconds and
leaves no process behind; Ray stays optional."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from executor.worker_checks import (
    StepLog,
    assert_close,
    assert_kill_fails_step,
    generate_outputs,
)
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.engine.engine_args import EngineArgs

PROMPTS = [[1, 504, 358, 314, 407, 28, 23, 23, 23], [9, 9, 9, 240, 17]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class Hf:
    vocab_size = 512
    max_position_embeddings = 128


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (this container's init may not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except (FileNotFoundError, ProcessLookupError):  # (gone between the open and the read)
        return True


def _cmdline(pid: int) -> str:
    """A process's command line, "" where it is gone (also between the open and the read)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def test_serve_starts_its_own_ray_and_leaves_nothing_behind(tiny_llama_dir, monkeypatch):
    """`shoal serve --distributed-executor-backend ray` without RAY_ADDRESS: the engine core
    starts a local Ray cluster, answers like one rank, and at exit no process of it is left.
    (First in the file: the module's own Ray cluster below is not up yet.)"""
    pytest.importorskip("ray")
    from entrypoints.conftest import RemoteServer

    one = _llm(1, None, str(tiny_llama_dir))
    try:
        expected = _generate(one)[0][:8]
    finally:
        one.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = RemoteServer(str(tiny_llama_dir), "--tensor-parallel-size", "2",
                          "--distributed-executor-backend", "ray", "--device", "cpu",
                          "--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "128")
    try:
        out = server.openai().completions.create(
            model=str(tiny_llama_dir), prompt=PROMPTS[0], max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert list(out.choices[0].token_ids) == expected
        procs = _descendants(server.proc.pid)
        assert any("raylet" in _cmdline(p) for p in procs)
    finally:
        server.stop()
    deadline = time.monotonic() + 15
    while not all(_exited(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_exited(p) for p in procs), "processes of the server's Ray cluster were left"


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # Four logical CPUs (one bundle per rank, 2 x 2 ranks at most) on this two-core machine.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 << 20)
    try:
        yield ray
    finally:
        ray.shutdown()


def _llm(tp: int, backend: str | None, model: str | None = None, **kwargs) -> LLM:
    """The embedded SmolLM2 unless a model is given (float32 for the tiny checkpoints)."""
    kw = {"dtype": "float32", "max_model_len": 128} if model else {"max_model_len": 256}
    return LLM(model=model, tensor_parallel_size=tp, distributed_executor_backend=backend,
               device="cpu", kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False,
               **kw, **kwargs)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _pg_states(ray) -> list[str]:  # noqa: ANN001
    from ray.util import placement_group_table

    return [pg["state"] for pg in placement_group_table().values()]


def test_three_ray_ranks_generate_what_one_rank_does(ray_cluster):
    torch.set_num_threads(1)
    one = _llm(1, None)
    try:
        expected = _generate(one)
    finally:
        one.shutdown()
    llm = _llm(3, "ray")
    try:
        runner = llm.llm_engine.core.runner
        assert type(runner).__name__ == "RayExecutor" and runner.world == 3
        assert len(runner._actors) == 2 and len(runner._pids) == 2
        full = runner.driver.hf_config.num_attention_heads
        assert runner.driver.model.attention_layers()[0].num_heads * 3 == full  # really split
        assert "CREATED" in _pg_states(ray_cluster)
        assert _generate(llm) == expected
        pids = list(runner._pids)
    finally:
        llm.shutdown()
    assert all(_exited(p) for p in pids), "an actor outlived shutdown"
    assert "CREATED" not in _pg_states(ray_cluster), "the placement group outlived shutdown"


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_a_killed_actor_fails_the_requests_in_flight(ray_cluster, tiny_llama_dir, pp):
    """A tensor-parallel rank's actor, or a pipeline stage's, killed mid-request."""
    torch.set_num_threads(1)
    llm = _llm(3 - pp, "ray", str(tiny_llama_dir), pipeline_parallel_size=pp)
    try:
        engine = llm.llm_engine
        runner = engine.core.runner
        pids = list(runner._pids)
        assert_kill_fails_step(
            engine, lambda: ray_cluster.kill(runner._actors[0], no_restart=True), PROMPTS,
            max_tokens=200)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while not all(_exited(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_exited(p) for p in pids)
    assert "CREATED" not in _pg_states(ray_cluster)


def test_pipeline_stages_on_ray_match_one_rank(ray_cluster, tmp_path, monkeypatch):
    """Two stages through Ray (the actors run the mp worker's commands): a 3-layer Llama split
    unevenly by SHOAL_PP_LAYER_PARTITION (which reaches the actor), with two micro-batches in
    flight, 2 stages x 2 TP ranks. Tokens and logprobs equal one rank's."""
    torch.set_num_threads(1)
    path = str(write_tiny_checkpoint(tmp_path / "llama3", "llama", num_hidden_layers=3))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(3 + 2 * i)]}
               for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    one = _llm(1, None, path)
    try:
        expected = generate_outputs(one, prompts, params)
    finally:
        one.shutdown()
    monkeypatch.setenv("SHOAL_PP_LAYER_PARTITION", "1,2")  # evenly it would be 2 + 1
    tp = 2  # (2 stages of one rank each: test_a_killed_actor_fails_the_requests_in_flight)
    llm = _llm(tp, "ray", path, pipeline_parallel_size=2)
    try:
        runner = llm.llm_engine.core.runner
        assert type(runner).__name__ == "RayExecutor" and runner.world == 2 * tp
        assert len(runner._actors) == 2 * tp - 1
        model = runner.driver.model
        assert (model.model.start_layer, model.model.end_layer) == (0, 1)
        assert len(runner.driver.kv_caches) == 1
        full = runner.driver.hf_config.num_attention_heads
        assert model.attention_layers()[0].num_heads * tp == full
        log = StepLog(runner)
        got = generate_outputs(llm, prompts, params)
        assert log.most == 2
        pids = list(runner._pids)
    finally:
        llm.shutdown()
    assert_close(expected, got, 1e-4)
    assert all(_exited(p) for p in pids), "an actor outlived shutdown"
    assert "CREATED" not in _pg_states(ray_cluster)


def test_ray_without_ray_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, find_spec sees none
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install"):
        EngineArgs(device="cpu", tensor_parallel_size=2,
                   distributed_executor_backend="ray").create_engine_config(Hf())
    from shoal.executor import ray_executor

    with pytest.raises(ValueError, match="needs Ray"):
        ray_executor._import_ray()
    # The default never picks ray then: too few GPUs stays mp (and its clear GPU-count error).
    args = EngineArgs(tensor_parallel_size=4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert args._executor_backend(torch.device("cuda"), 4) == "mp"


def test_default_backend_follows_vllm():
    pytest.importorskip("ray")
    args = EngineArgs()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert args._executor_backend(cpu, 1) == "uni"
    assert args._executor_backend(cpu, 2) == "mp"
    import unittest.mock

    with unittest.mock.patch.object(torch.cuda, "device_count", lambda: 2):
        assert args._executor_backend(cuda, 1) == "uni"
        assert args._executor_backend(cuda, 2) == "mp"
        assert args._executor_backend(cuda, 4) == "ray"  # more ranks than this host's GPUs
        assert args._executor_backend(torch.device("cuda", 1), 2) == "ray"
        # pipeline stages follow the same rule (world = tp x pp ranks)
        assert EngineArgs(pipeline_parallel_size=2)._executor_backend(cuda, 2) == "mp"
        assert EngineArgs(pipeline_parallel_size=2)._executor_backend(cuda, 4) == "ray"
    assert EngineArgs(distributed_executor_backend="mp")._executor_backend(cuda, 8) == "mp"


def test_importing_shoal_does_not_import_ray():
    code = ("import sys, shoal, shoal.executor, shoal.engine.engine_args, shoal.llm; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
