"""DeepSeek-V4 under data parallel + expert parallel (DP+EP) and under plain expert parallelism
(enable_expert_parallel inside tensor_parallel_size 2), fp32 on gloo, on the tiny checkpoints
of test_deepseek_v4.py (4 layers: 2 hash-routed, 2 top-k routed MoE layers) and
test_deepseek_v4_mtp.py (3 layers and an MTP layer).

DP+EP: two offline replicas (one LLM per process) hold 4 of the 8 routed experts each; a
hash layer looks its experts up from the replica's own token ids before the all-to-all
dispatch; attention, hyper-connections, routers and the shared expert are whole on both. Rank
0 runs every prompt while rank 1 only joins the MoE exchanges with dummy passes (one made-up
token through V4's attention and hyper-connections), then each runs half (the 137-token
prompt in chunks on rank 1 while rank 0, done early, idles). Greedy tokens and logprobs are
the one-rank engine's (within 1e-4). With MTP (k=2) the drafter's MoE layer splits its
experts too and its passes run in lockstep: tokens are the plain engine's and every proposal
is the MTP formula's."""

from __future__ import annotations

import os
import random
import socket

import pytest
import torch
import torch.multiprocessing as mp
from models.test_deepseek_v4 import tiny  # noqa: F401 (fixture)
from models.test_deepseek_v4_mtp import ckpt  # noqa: F401 (fixture)
from safetensors import safe_open

from shoal import LLM, SamplingParams

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=256,
              max_num_batched_tokens=32)
# On CUDA (NCCL, a GPU a replica) eagerly, as DP+EP runs; the one-rank reference beside
# replica 0 on the first GPU
CUDA = dict(enforce_eager=True, gpu_memory_utilization=0.3)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])
MAX_TOKENS = 6
HIDDEN, INTER = 64, 32
SEEDS = {"plain": 1, "mtp": 2}  # each case's prompts


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 13, 30, 137)]


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def _tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    return [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for c in (o.outputs[0] for o in outs)]


def _engine(device: str, rank: int = 0) -> dict:
    if device == "cpu":
        return dict(ENGINE, device="cpu")
    return dict(ENGINE, device=f"cuda:{rank}", **CUDA)


_ONE_RANK: dict[tuple[str, int, str], list[tuple[list[int], list[float]]]] = {}


def _one_rank(path: str, seed: int, device: str = "cpu"):
    """Greedy tokens and logprobs of _prompts(seed) on one rank, every expert local."""
    key = (path, seed, device)
    if key not in _ONE_RANK:
        llm = LLM(model=path, **_engine(device))
        try:
            _ONE_RANK[key] = _tokens_and_logprobs(llm.generate(
                [{"prompt_token_ids": p} for p in _prompts(seed)], _greedy(), use_tqdm=False))
        finally:
            llm.shutdown()
    return _ONE_RANK[key]


def _assert_same(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp), (_, ref) in zip(got, want):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-4, rtol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _experts(model: torch.nn.Module) -> list[tuple[int, int, tuple[int, ...]]]:
    from shoal.layers.moe.layer import FusedMoE

    return [(m.local_num_experts, m.expert_start, tuple(m.w13_weight.shape))
            for m in model.modules() if isinstance(m, FusedMoE)]


def _replica(rank: int, cases: list[tuple[str, str, dict | None, int]], device: str,
             out: str) -> None:
    """Each case (name, checkpoint, speculative_config, master port): rank 0 runs every
    prompt while rank 1 idles, then half each (rank 0's shorter, so it idles meanwhile)."""
    from spec_decode.proposal_log import record_proposals
    from spec_decode.test_spec_engine import SpecCounter

    torch.set_num_threads(1)
    results = {}
    for name, path, spec, port in cases:
        llm = LLM(model=path, data_parallel_size=2, enable_expert_parallel=True,
                  data_parallel_rank=rank, data_parallel_master_port=port,
                  speculative_config=spec, **_engine(device, rank))
        try:
            core = llm.llm_engine.core
            model, drafter = core.runner.model, core.runner.drafter
            layer0 = model.model.layers[0].mlp
            counter = SpecCounter(llm) if spec else None
            log = record_proposals(llm) if spec else []
            prompts = [{"prompt_token_ids": p} for p in _prompts(SEEDS[name])]
            first = llm.generate(prompts if rank == 0 else [], _greedy(), use_tqdm=False)
            dummies = core.dp_lockstep.dummy_steps
            second = llm.generate(prompts[rank::2], _greedy(MAX_TOKENS // 2 if rank == 0
                                                            else MAX_TOKENS), use_tqdm=False)
            results[name] = {
                "first": _tokens_and_logprobs(first), "second": _tokens_and_logprobs(second),
                "dummy_steps": dummies, "experts": _experts(model),
                "w13": layer0.experts.w13_weight.detach().to("cpu", copy=True),
                "tid2eid": tuple(layer0.gate.tid2eid.shape),
                "shared": tuple(layer0.shared_experts.gate_proj.weight.shape),
                "spec": None if counter is None else (counter.drafts, counter.accepted),
                "proposals": [(list(s), list(d)) for s, d in log],
                "draft_experts": _experts(drafter.model) if spec else [],
                "dummy_passes": (core.runner.draft_lockstep.dummy_passes
                                 if core.runner.draft_lockstep is not None else None)}
        finally:
            llm.shutdown()
    torch.save(results, out)
    os._exit(0)


def _checkpoint_experts(path: str, first: int, n: int) -> torch.Tensor:
    """Layer 0's experts [first, first + n) from the checkpoint, as w13 stacks [n, 2I, H]."""
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return torch.stack([torch.cat([f.get_tensor(f"model.layers.0.ffn.experts.{e}.{w}.weight")
                                       for w in ("w1", "w3")]) for e in range(first, first + n)])


@pytest.mark.parametrize("device", DEVICES)
def test_replicas_split_the_experts_and_match_one_rank(tiny, ckpt, tmp_path,  # noqa: F811
                                                       device):
    plain_path, mtp_path = str(tiny[0]), str(ckpt[0])
    reference = ckpt[1]
    cases = [("plain", plain_path, None, _free_port()),
             ("mtp", mtp_path, {"method": "mtp", "num_speculative_tokens": 2}, _free_port())]
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    procs = [ctx.Process(target=_replica, args=(r, cases, device, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    # Meanwhile: the one-rank references.
    want = {name: _one_rank(path, SEEDS[name], device) for name, path, _, _ in cases}
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (torch.load(o, weights_only=False) for o in outs)
    for name, path, _, _ in cases:
        a, b, ref = r0[name], r1[name], want[name]
        _assert_same(a["first"], ref)
        assert b["first"] == [] and b["dummy_steps"] >= MAX_TOKENS, name  # stepped with 0
        _assert_same(a["second"], [(t[:MAX_TOKENS // 2], lp[:MAX_TOKENS // 2])
                                   for t, lp in ref[0::2]])
        _assert_same(b["second"], ref[1::2])
        # every MoE layer: 4 of the 8 experts whole on each replica, the checkpoint's own
        layers = {"plain": 4, "mtp": 3}[name]  # every decoder layer is a MoE layer
        assert a["experts"] == [(4, 0, (4, 2 * INTER, HIDDEN))] * layers, name
        assert b["experts"] == [(4, 4, (4, 2 * INTER, HIDDEN))] * layers, name
        for rank, r in enumerate((a, b)):
            torch.testing.assert_close(r["w13"], _checkpoint_experts(path, 4 * rank, 4),
                                       atol=0, rtol=0)
        # the hash table and the shared expert whole on each replica
        assert a["tid2eid"] == b["tid2eid"] == (512, 2)
        assert a["shared"] == b["shared"] == (INTER, HIDDEN)
    # MTP: the drafter's experts split too, its passes in lockstep (rank 1 ran rank 0's as
    # dummies), drafts accepted on both replicas and each one the MTP formula's
    a, b = r0["mtp"], r1["mtp"]
    assert a["draft_experts"] == [(4, 0, (4, 2 * INTER, HIDDEN))]
    assert b["draft_experts"] == [(4, 4, (4, 2 * INTER, HIDDEN))]
    assert b["dummy_passes"] > MAX_TOKENS
    assert a["spec"][1] > 0 and b["spec"][1] > 0, (a["spec"], b["spec"])
    proposals = a["proposals"] + b["proposals"]
    assert len(proposals) > 10
    for seq, drafts in proposals:
        assert drafts == reference.drafts(seq, len(drafts)), len(seq)


def test_expert_parallel_inside_two_tensor_parallel_ranks(tiny):  # noqa: F811
    """enable_expert_parallel with tensor_parallel_size 2 (every token on both ranks): each
    rank 4 experts whole, the shared expert's intermediate dim halved, one all-reduce."""
    path = str(tiny[0])
    prompts = _prompts(SEEDS["plain"])
    want = _one_rank(path, SEEDS["plain"])
    llm = LLM(model=path, tensor_parallel_size=2, enable_expert_parallel=True,
              **_engine("cpu"))
    try:
        model = llm.llm_engine.core.runner.driver.model
        assert _experts(model) == [(4, 0, (4, 2 * INTER, HIDDEN))] * 4
        mlp = model.model.layers[0].mlp
        assert tuple(mlp.shared_experts.gate_proj.weight.shape) == (INTER // 2, HIDDEN)
        got = _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                _greedy(), use_tqdm=False))
    finally:
        llm.shutdown()
    _assert_same(got, want)
