"""Expert parallelism (enable_expert_parallel): on two ranks each holds half of the experts
whole, tokens stay replicated and one all-reduce sums the ranks' parts. The layer against the
unsplit one in one process, Qwen3-MoE and DeepSeek-V3 on a two-rank gloo group against one
rank, the engine's greedy tokens against one rank, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from deepseek_tiny import V3, write_deepseek
from gloo_harness import prompt_logits, run_on_two_ranks
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.distributed.parallel_state import (
    expert_parallel,
    expert_parallel_enabled,
    get_ep_world_size,
)
from shoal.engine.engine_args import EngineArgs
from shoal.layers.moe import layer as moe_layer
from shoal.layers.moe.layer import FusedMoE, _mask_foreign, fused_experts
from shoal.layers.moe.torch_experts import experts_dense
from shoal.loader import load_model
from shoal.models.registry import resolve_model_class

QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9]]


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-moe-ep"), "qwen3_moe", seed=3,
                                 **QWEN3_MOE)


@pytest.fixture(scope="module")
def deepseek_v3_dir(tmp_path_factory):
    path, _ = write_deepseek(tmp_path_factory.mktemp("deepseek-v3-ep"), "deepseek_v3", 1, **V3)
    return path


# ---- the layer, in one process ----------------------------------------------------------------


def _as_rank(monkeypatch, ep: int, rank: int) -> None:
    monkeypatch.setattr(moe_layer, "get_ep_world_size", lambda: ep)
    monkeypatch.setattr(moe_layer, "get_ep_rank", lambda: rank)


def _load(moe: FusedMoE, w1, w3, w2) -> None:
    for e in range(w1.shape[0]):
        moe.weight_loader(moe.w13_weight, w1[e], e, "w1")
        moe.weight_loader(moe.w13_weight, w3[e], e, "w3")
        moe.weight_loader(moe.w2_weight, w2[e], e, "w2")


def test_layer_ranks_sum_to_the_unsplit_layer(monkeypatch):
    torch.manual_seed(0)
    e, h, i, t, k = 6, 16, 8, 9, 2
    w1, w3, w2 = torch.randn(e, i, h), torch.randn(e, i, h), torch.randn(e, h, i)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    full = FusedMoE(e, h, i)
    _load(full, w1, w3, w2)
    expected = full(x, weights, ids)
    total = torch.zeros_like(expected)
    for rank in range(3):
        _as_rank(monkeypatch, 3, rank)
        part = FusedMoE(e, h, i)
        assert part.w13_weight.shape == (2, 2 * i, h) and part.w2_weight.shape == (2, h, i)
        _load(part, w1, w3, w2)  # other ranks' experts are skipped without error
        torch.testing.assert_close(part.w13_weight, full.w13_weight[2 * rank:2 * rank + 2])
        torch.testing.assert_close(part.w2_weight, full.w2_weight[2 * rank:2 * rank + 2])
        total += part(x, weights, ids)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_foreign_ids_contribute_nothing_on_every_path():
    """Id E (another rank's expert): skipped by the PyTorch path, expert 0 with weight 0 for
    the dense (graph-capture) and Triton paths."""
    torch.manual_seed(1)
    e, h, i, t = 3, 8, 4, 5
    w13, w2, x = torch.randn(e, 2 * i, h), torch.randn(e, h, i), torch.randn(t, h)
    ids = torch.tensor([[0, 3], [3, 3], [2, 1], [3, 0], [1, 2]])
    weights = torch.rand(t, 2)
    mine = ids < e
    ref = fused_experts(x, w13, w2, torch.where(mine, weights, 0.0),
                        torch.where(mine, ids, 0), use_triton_ops=False)
    got = fused_experts(x, w13, w2, weights, ids, use_triton_ops=False, foreign_ids=True)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got[1], torch.zeros(h))
    masked_ids, masked_w = _mask_foreign(ids, weights, e)
    assert masked_ids.dtype == ids.dtype and int(masked_ids.max()) < e
    torch.testing.assert_close(experts_dense(x, w13, w2, masked_w, masked_ids), ref,
                               atol=1e-5, rtol=1e-5)


def test_experts_not_divisible_by_ranks_is_an_error(monkeypatch):
    _as_rank(monkeypatch, 4, 0)
    with pytest.raises(ValueError, match=r"number of experts \(6\) is not divisible by the "
                                         r"expert-parallel size \(4"):
        FusedMoE(6, 8, 4)


def test_expert_parallel_is_a_no_op_without_a_tensor_parallel_group():
    with expert_parallel(True):
        assert expert_parallel_enabled() and get_ep_world_size() == 1
        moe = FusedMoE(4, 8, 6)
    assert not expert_parallel_enabled()
    assert moe.w13_weight.shape == (4, 12, 8) and moe.ep_size == 1


# ---- two gloo ranks against one ---------------------------------------------------------------


def _ep_logits_and_experts(path: str, enable: bool) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """The prompt's logits; this rank's stacked w13 shape of the first MoE layer; every rank's
    w13 of that layer concatenated over experts (the whole stack, gathered)."""
    loaded = load_model(path)
    with expert_parallel(enable):
        model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32)
    model.load_weights(loaded.weights())
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    w13 = moe.w13_weight.data
    gathered = w13
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(w13) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, w13.contiguous())
        gathered = torch.cat(parts)
    return prompt_logits(model), tuple(w13.shape), gathered


@pytest.mark.parametrize("which", ["qwen3_moe", "deepseek_v3"])
def test_two_ranks_with_expert_parallel_match_one_rank(which, qwen3_moe_dir, deepseek_v3_dir):
    path = str(qwen3_moe_dir if which == "qwen3_moe" else deepseek_v3_dir)
    expected, full_shape, full_w13 = _ep_logits_and_experts(path, False)
    got, shape, gathered = run_on_two_ranks(_ep_logits_and_experts, path, True)
    # Each rank holds half of the experts, whole (all of the intermediate rows).
    assert shape == (full_shape[0] // 2, *full_shape[1:])
    torch.testing.assert_close(gathered, full_w13, atol=0, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# ---- through the engine -----------------------------------------------------------------------


def _generate(path: str, tp: int, ep: bool) -> tuple[list[list[int]], tuple]:
    llm = LLM(model=path, tensor_parallel_size=tp, enable_expert_parallel=ep, device="cpu",
              dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22,
              enable_prefix_caching=False)
    try:
        runner = llm.llm_engine.core.runner
        model = runner.driver.model if tp > 1 else runner.model
        moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], tuple(moe.w13_weight.shape)
    finally:
        llm.shutdown()


def test_engine_with_expert_parallel_generates_what_one_rank_does(qwen3_moe_dir):
    torch.set_num_threads(1)
    one, full_shape = _generate(str(qwen3_moe_dir), 1, False)
    two, shape = _generate(str(qwen3_moe_dir), 2, True)
    assert shape == (full_shape[0] // 2, *full_shape[1:])  # rank 0: experts 0..3, whole
    assert two == one


class _Hf:
    vocab_size = 512
    max_position_embeddings = 128


def test_engine_args_carry_the_flag():
    cfg = EngineArgs(device="cpu", tensor_parallel_size=2,
                     enable_expert_parallel=True).create_engine_config(_Hf())
    assert cfg.parallel_config.enable_expert_parallel
    # Accepted, as in vLLM, for any model and at one rank (a no-op there).
    cfg = EngineArgs(device="cpu", enable_expert_parallel=True).create_engine_config(_Hf())
    assert cfg.parallel_config.enable_expert_parallel
    assert not EngineArgs(device="cpu").create_engine_config(
        _Hf()).parallel_config.enable_expert_parallel


@pytest.mark.parametrize("kwargs, message", [
    ({"enable_expert_parallel": "yes"}, "enable_expert_parallel must be a bool"),
    # DP+EP (tests/executor/test_dp_expert_parallel.py) needs each replica's rank and port.
    ({"enable_expert_parallel": True, "data_parallel_size": 2}, "needs data_parallel_rank in"),
])
def test_unsupported_expert_parallel_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", **kwargs).create_engine_config(_Hf())


def test_serve_flag():
    import argparse

    from shoal.entrypoints.cli_args import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    ns = parser.parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert engine_args_from(ns).enable_expert_parallel is True
    assert engine_args_from(parser.parse_args([])).enable_expert_parallel is False
