"""Speculative decoding under DP+EP: two offline replicas (gloo) whose MoE experts are split
between them, each drafting for its own requests. ngram on a tiny Qwen3-MoE; a draft model
that is that same MoE (its experts split too: every draft accepted only if its all-to-alls
pair up); DeepSeek-V3's MTP layers (two, chained; their experts split, each depth's passes
agreed: shoal/worker/draft_lockstep.py). Greedy tokens are the plain one-rank engine's on
both replicas, and MTP proposes what it proposes on one rank, while a replica idles (a whole
generate call, or after its shorter requests) and the other speculates."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp
from deepseek_tiny import V3, write_deepseek
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file
from spec_decode.proposal_log import record_proposals
from spec_decode.test_multi_layer_mtp import _extra, _save
from spec_decode.test_spec_engine import SpecCounter

from shoal import LLM, SamplingParams

QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
N, DEPTHS, K = V3["num_hidden_layers"], 2, 3
# Repeats for prompt lookup; the last one takes two prefill chunks (a step that mirrors
# without drafting on its replica while the other drafts).
PROMPTS = [[5, 17, 300, 42, 7, 5, 17, 300], [256, 3, 11, 400, 23, 8, 1, 2, 3, 256, 3, 11],
           [9, 9, 9], [*range(40, 60), *range(40, 50)]]
MAX_TOKENS = 8
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22,
              enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _mtp_checkpoint(root):
    """A DeepSeek-V3 target with two MTP layers whose main layers add nothing to the
    residual and whose MTP depths are mostly the resulting bigram (test_multi_layer_mtp.py's
    "bigram"): most drafts are accepted, so verify steps mirror accepted drafts too."""
    full, _ = write_deepseek(root / "full", "deepseek_v3", seed=3,
                             **dict(V3, num_hidden_layers=N + DEPTHS))
    cfg = json.loads((full / "config.json").read_text())
    weights = {n: t * (0.0 if int(m[1]) < N else 0.02)
               if (m := re.match(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\..*down_proj)"
                                 r"\.weight$", n)) else t
               for n, t in load_file(full / "model.safetensors").items()}
    return _save(root / "mtp", cfg, {**weights, **_extra(12, weights, {0, 1})},
                 num_hidden_layers=N, num_nextn_predict_layers=DEPTHS)


def _cases(moe: str, mtp: str) -> list[tuple[str, str, dict]]:
    return [("ngram", moe, {"method": "ngram", "num_speculative_tokens": K,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
            ("draft_model", moe, {"method": "draft_model", "model": moe,
                                  "num_speculative_tokens": K}),
            ("mtp", mtp, {"method": "mtp", "num_speculative_tokens": K})]


def _replica(rank: int, ports: list[int], cases, out: str) -> None:
    """Each case in turn: rank 0 runs every prompt while rank 1 idles, then half each (rank
    0's shorter, so it idles while rank 1 still speculates)."""
    from shoal.layers.moe.layer import FusedMoE

    torch.set_num_threads(1)
    results = {}
    for port, (name, model, spec) in zip(ports, cases):
        llm = LLM(model=model, data_parallel_size=2, enable_expert_parallel=True,
                  data_parallel_rank=rank, data_parallel_master_port=port,
                  speculative_config=spec, **ENGINE)
        try:
            runner = llm.llm_engine.core.runner
            counter = SpecCounter(llm)
            log = record_proposals(llm) if name == "mtp" else []
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            first = llm.generate(prompts if rank == 0 else [], _greedy(), use_tqdm=False)
            second = llm.generate(prompts[rank::2], _greedy(MAX_TOKENS // 2 if rank == 0
                                                            else MAX_TOKENS), use_tqdm=False)
            drafter = getattr(runner.drafter, "model", None)
            lockstep = runner.draft_lockstep
            results[name] = {
                "first": _tokens(first), "second": _tokens(second),
                "spec": (counter.drafts, counter.draft_tokens, counter.accepted),
                "proposals": [(tuple(s), d) for s, d in log],
                "draft_experts": [tuple(m.w13_weight.shape) for m in drafter.modules()
                                  if isinstance(m, FusedMoE)] if drafter is not None else [],
                "dummy_passes": None if lockstep is None else lockstep.dummy_passes}
        finally:
            llm.shutdown()
    torch.save(results, out)
    os._exit(0)


def _one_rank(model: str, spec: dict | None = None):
    """Greedy tokens of PROMPTS on one rank (every expert local), and with `spec` its
    proposals (sequence -> drafts)."""
    llm = LLM(model=model, speculative_config=spec, **ENGINE)
    try:
        log = record_proposals(llm) if spec is not None else []
        tokens = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(),
                                      use_tqdm=False))
        return tokens, {tuple(s): d for s, d in log}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-dpep")
    moe = write_tiny_checkpoint(root / "qwen3-moe", "qwen3_moe", seed=3, **QWEN3_MOE)
    return str(moe), str(_mtp_checkpoint(root))


def test_replicas_speculate_as_one_rank(checkpoints, tmp_path):
    moe, mtp = checkpoints
    cases = _cases(moe, mtp)
    ctx = mp.get_context("spawn")
    ports = [_free_port() for _ in cases]
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    procs = [ctx.Process(target=_replica, args=(r, ports, cases, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    # Meanwhile: the references on one rank.
    plain = {moe: _one_rank(moe)[0], mtp: _one_rank(mtp)[0]}
    mtp_tokens, mtp_proposals = _one_rank(mtp, cases[2][2])
    assert mtp_tokens == plain[mtp]
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (torch.load(o, weights_only=False) for o in outs)
    for name, model, _ in cases:
        a, b, want = r0[name], r1[name], plain[model]
        assert a["first"] == want and b["first"] == [], name
        assert a["second"] == [t[:MAX_TOKENS // 2] for t in want[0::2]], name
        assert b["second"] == want[1::2], name
        assert a["spec"][0] > 0 and b["spec"][0] > 0, (name, a["spec"], b["spec"])  # drafted
        if name == "ngram":  # drafted on the host: nothing to agree on
            assert a["dummy_passes"] is None and a["draft_experts"] == []
            continue
        # 8 experts over 2 replicas in every MoE layer of the drafter; rank 1 ran the
        # drafter's passes of rank 0's first generate call as dummies
        assert set(a["draft_experts"]) == set(b["draft_experts"]) == {(4, 64, 64)}, name
        assert b["dummy_passes"] > MAX_TOKENS, name
    for r in (r0, r1):  # the draft model is the target: its drafts are the target's tokens
        _, draft_tokens, accepted = r["draft_model"]["spec"]
        assert accepted == draft_tokens, r["draft_model"]["spec"]
    # MTP drafts exactly what it drafts on one rank (split experts, padded depths and all)
    proposals = r0["mtp"]["proposals"] + r1["mtp"]["proposals"]
    assert len(proposals) > 20
    for seq, drafts in proposals:
        assert mtp_proposals.get(seq, drafts) == drafts, seq
    assert sum(seq in mtp_proposals for seq, _ in proposals) > 20
    assert r0["mtp"]["spec"][2] > 0 and r1["mtp"]["spec"][2] > 0  # accepted drafts too
