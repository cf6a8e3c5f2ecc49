"""DP+EP: data-parallel replicas that split the MoE experts between them (all-to-all token
dispatch, shoal/layers/moe/all_to_all.py) and step in lockstep (shoal/engine/dp_lockstep.py).
The dispatch against every expert on one rank, two offline replicas and a two-replica server
against one rank (greedy tokens and logprobs), a replica that idles while the other works, a
replica killed mid-request, and the settings refused."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import dp_ep_ranks
import httpx
import pytest
import torch
import torch.multiprocessing as mp
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.engine.engine_args import EngineArgs

QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9],
           [1, 2, 3, 4]]
MAX_TOKENS = 8
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22,
              enable_prefix_caching=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids),
                       [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return result


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-moe-dpep"), "qwen3_moe", seed=3,
                                 **QWEN3_MOE)


@pytest.fixture(scope="module")
def one_rank(moe_dir):
    """Greedy tokens and their logprobs of PROMPTS on one rank, every expert local."""
    llm = LLM(model=str(moe_dir), **ENGINE)
    try:
        return _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                 _greedy(), use_tqdm=False))
    finally:
        llm.shutdown()


def _assert_same(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lp), (_, ref) in zip(got, expected):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-4, rtol=0)


# ---- the dispatch, on two gloo ranks ------------------------------------------------------------

def test_all_to_all_dispatch_matches_every_expert_on_one_rank():
    mp.spawn(dp_ep_ranks.all_to_all_rank, args=(2, _free_port()), nprocs=2, join=True)


# ---- offline: one LLM per replica -------------------------------------------------------------


def _offline_replica(rank: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    llm = LLM(model=path, data_parallel_size=2, enable_expert_parallel=True,
              data_parallel_rank=rank, data_parallel_master_port=port, **ENGINE)
    try:
        core = llm.llm_engine.core
        from shoal.layers.moe.layer import FusedMoE

        moe = next(m for m in core.runner.model.modules() if isinstance(m, FusedMoE))
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        # Uneven: rank 0 runs everything, rank 1 has nothing and runs dummy steps meanwhile.
        first = llm.generate(prompts if rank == 0 else [], _greedy(), use_tqdm=False)
        dummies = core.dp_lockstep.dummy_steps
        # Even: each replica its half.
        second = llm.generate(prompts[rank::2], _greedy(), use_tqdm=False)
        result = {"first": _tokens_and_logprobs(first), "second": _tokens_and_logprobs(second),
                  "dummies": dummies, "w13": tuple(moe.w13_weight.shape)}
        if rank == 1:  # dies without a word: rank 0's next generate must fail, not hang
            torch.save(result, out)
            os._exit(0)
        t0 = time.monotonic()
        try:
            llm.generate(prompts, _greedy(), use_tqdm=False)
        except Exception as e:
            result["lost"] = (type(e).__name__, time.monotonic() - t0)
        torch.save(result, out)
    finally:
        llm.shutdown()
    os._exit(0)


def test_offline_replicas_generate_what_one_rank_does(moe_dir, one_rank, tmp_path):
    """Rank 0 alone with all prompts while rank 1 runs dummy steps, then half each; then
    rank 1 exits and rank 0's next generate fails at once."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    procs = [ctx.Process(target=_offline_replica, args=(r, port, str(moe_dir), outs[r]))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (torch.load(o, weights_only=False) for o in outs)
    assert r0["w13"] == r1["w13"] == (4, 64, 64)  # 8 experts over 2 replicas, whole
    _assert_same(r0["first"], one_rank)
    assert r1["first"] == [] and r1["dummies"] >= MAX_TOKENS  # it stepped with rank 0
    _assert_same(r0["second"] + r1["second"], one_rank[0::2] + one_rank[1::2])
    name, took = r0["lost"]  # replica 1 gone: an error within seconds, and a clean shutdown
    assert name == "DPPeerLostError" and took < 10


# ---- a server of two replicas ---------------------------------------------------------------


def _replica_pids(server) -> dict[int, int]:
    log = server.log_tail(200000)
    return {int(r): int(p) for r, p in
            re.findall(r"DP\+EP: replica (\d+) of 2 \(pid (\d+)\)", log)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie of the server's (not reaped yet) is gone too.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"


def test_server_of_two_replicas(moe_dir, one_rank):
    """Greedy answers as one rank; one request alone (the other replica idles and steps with
    it); then a replica killed mid-request: the request fails within seconds, /health is 503
    and no engine process is left."""
    import openai
    from entrypoints.conftest import RemoteServer

    server = RemoteServer(str(moe_dir), "--data-parallel-size", "2",
                          "--enable-expert-parallel", "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", "512", "--max-num-seqs", "4",
                          "--no-enable-prefix-caching", base_args=[
                              "--kv-cache-memory-bytes", str(2**22),
                              "--disable-uvicorn-access-log"])
    try:
        pids = _replica_pids(server)
        assert sorted(pids) == [0, 1]
        client = server.openai()
        extra = {"ignore_eos": True, "return_token_ids": True}
        out = client.completions.create(model=str(moe_dir), prompt=PROMPTS,
                                        max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                        extra_body=extra)
        got = [(list(c.token_ids), list(c.logprobs.token_logprobs))
               for c in sorted(out.choices, key=lambda c: c.index)]
        _assert_same(got, one_rank)
        alone = client.completions.create(model=str(moe_dir), prompt=PROMPTS[1],
                                          max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=extra)
        assert list(alone.choices[0].token_ids) == one_rank[1][0]

        # A long request on replica 0 (the least loaded, lowest rank); kill replica 1.
        stream = client.completions.create(model=str(moe_dir), prompt=PROMPTS[0],
                                           max_tokens=480, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="engine"):  # the stream ends with an error
            for _ in chunks:
                pass
        assert time.monotonic() - t0 < 10
        health = None
        try:
            health = httpx.get(server.base_url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            pass  # the server already exited after its grace period: as good as a 503
        assert health in (None, 503)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_gone(p) for p in pids.values()):
            time.sleep(0.2)
        assert all(_gone(p) for p in pids.values()), server.log_tail()
        # The survivor failed in a collective and exited by itself (it did not need the
        # frontend to stop it).
        assert "the engine core loop failed; the engine exits" in server.log_tail(200000)
    finally:
        server.stop()


# ---- settings ---------------------------------------------------------------------------------


class _Hf:
    vocab_size = 512
    max_position_embeddings = 128


def test_dp_ep_config():
    cfg = EngineArgs(device="cpu", data_parallel_size=2, enable_expert_parallel=True,
                     data_parallel_rank=1, data_parallel_master_port=1234
                     ).create_engine_config(_Hf())
    pc = cfg.parallel_config
    assert pc.dp_expert_parallel and (pc.data_parallel_rank, pc.data_parallel_size) == (1, 2)
    assert pc.distributed_executor_backend == "uni" and not cfg.async_scheduling


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2}, "needs tensor_parallel_size 1 and pipeline_parallel_size 1"),
    ({"async_scheduling": True}, "async_scheduling does not support"),
    ({"data_parallel_master_port": None}, "needs data_parallel_rank in"),
    ({"data_parallel_rank": 2}, "needs data_parallel_rank in"),
])
def test_dp_ep_refuses(kwargs, message):
    args = dict(device="cpu", data_parallel_size=2, enable_expert_parallel=True,
                data_parallel_rank=0, data_parallel_master_port=1234)
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{**args, **kwargs}).create_engine_config(_Hf())
