"""MoE layers expected to hold packed experts never allocate their dense expert stacks
(shoal/layers/moe/deferred_stacks.py), with the packed path let onto the CPU as the other
quantized-expert tests let it: dummy weights of a GPTQ, an FP8-block and a gpt-oss MXFP4 config
built as the engine builds them (random packed experts of valid codes and scales), and
checkpoint shards through the fast path, packed or (act-order) dequantized into stacks
allocated only then. Every FusedMoE stack Parameter is recorded as it is registered: one that
was ever given its dense memory would still hold it (materializing is in place)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

import shoal.models.gpt_oss as gpt_oss  # noqa: E402
from shoal.layers.moe.deferred_stacks import (  # noqa: E402
    STACKS,
    PackedExpertsPlan,
    check_none_deferred,
    is_deferred,
    packed_experts_expected,
)
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.moe.mxfp4_experts import (  # noqa: E402
    Mxfp4Experts,
    dequantize_mxfp4_experts,
    packed_experts_problem,
)
from shoal.quantization.fast_path import FastPath  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the packed path forced onto the CPU")
E, H, INTER = 4, 64, 64
COMMON = dict(vocab_size=256, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              torch_dtype="float32")
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 intermediate_size=128, moe_intermediate_size=INTER, num_experts=E,
                 num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], rope_theta=10000.0)
GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", intermediate_size=INTER,
               num_local_experts=E, num_experts_per_tok=2, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], rope_theta=150000.0,
               rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64})
GPTQ_G32 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
            "sym": True}


def _int4(q):
    from shoal.layers.moe.triton_experts_int4 import Int4Experts, dequantize_int4_experts

    assert isinstance(q, Int4Experts) and q.w13.zeros is None  # symmetric g32, as configured
    assert q.w13.scales.dtype == torch.float16 and q.w13.group == 32
    return dequantize_int4_experts(q.w13), dequantize_int4_experts(q.w2)


def _fp8(q):
    from shoal.layers.moe.triton_experts_fp8 import FP8Experts, dequantize_experts

    assert isinstance(q, FP8Experts) and q.group == 32
    # one scale per 32 x 32 tile (kept per row: tiles of 128 rows are the kernel's unit)
    assert torch.equal(q.w13_scale, q.w13_scale[:, ::32].repeat_interleave(32, 1))
    return (dequantize_experts(q.w13, q.w13_scale, q.scale_rows13, q.group),
            dequantize_experts(q.w2, q.w2_scale, q.scale_rows2, q.group))


def _mxfp4(q):
    assert isinstance(q, Mxfp4Experts)
    return dequantize_mxfp4_experts(q.w13), dequantize_mxfp4_experts(q.w2)


# config, quantization_config, the packed experts' dense weights (checking their kind)
DUMMY_CASES = {
    "gptq-int4": (QWEN3_MOE, GPTQ_G32, _int4),
    "fp8-block": (QWEN3_MOE, {"quant_method": "fp8", "activation_scheme": "dynamic",
                              "weight_block_size": [32, 32]}, _fp8),
    "gpt-oss-mxfp4": (GPT_OSS, {"quant_method": "mxfp4"}, _mxfp4),
}


@pytest.fixture
def stacks():
    """Every dense expert stack Parameter a FusedMoE registers while the test runs."""
    made: list[torch.nn.Parameter] = []

    def hook(module, name, param):
        if isinstance(module, FusedMoE) and name in STACKS and param is not None:
            made.append(param)

    handle = register_module_parameter_registration_hook(hook)
    yield made
    handle.remove()


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """The fast path's plan and gpt-oss's check as on CUDA, on the CPU (interpreter)."""
    plan = FastPath.plan.__func__
    monkeypatch.setattr(FastPath, "plan", classmethod(
        lambda cls, q, dtype, device, dummy=False, allow_cpu=False:
        plan(cls, q, dtype, device, dummy, True)))
    monkeypatch.setattr(gpt_oss, "packed_experts_problem",
                        functools.partial(packed_experts_problem, allow_cpu=True))


def _never_dense(params: list[torch.nn.Parameter]) -> bool:
    return bool(params) and all(
        is_deferred(p) and p.untyped_storage().nbytes() == p.element_size() for p in params)


@pytest.mark.parametrize("case", list(DUMMY_CASES))
def test_dummy_packed_experts_never_allocate_dense_stacks(case, stacks, packed_on_cpu,
                                                          tmp_path: Path) -> None:
    """load_format="dummy" as the engine builds it: every MoE layer holds random packed
    experts whose weights are finite, nonzero and of the dense dummy's scale (<= ~1e-3)."""
    from shoal.engine.engine_args import EngineArgs
    from shoal.loader.build import build_model
    from shoal.loader.load import load_model

    arch, quant, dense_of = DUMMY_CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(
        {**COMMON, **arch, "quantization_config": quant}))
    loaded = load_model(str(tmp_path), load_format="dummy")
    config = EngineArgs(model=str(tmp_path), dtype="float32", load_format="dummy",
                        device="cpu").create_engine_config(loaded.hf_config, str(tmp_path))
    model = build_model(config, loaded)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and len(stacks) == 4
    assert _never_dense(stacks)
    assert not [n for n, _ in model.named_parameters() if n.endswith(STACKS)]
    for moe in moes:
        w13, w2 = dense_of(moe.quant)
        assert w13.shape == (E, 2 * INTER, H) and w2.shape == (E, H, INTER)
        for w in (w13, w2):
            top = w.abs().max().item()
            assert torch.isfinite(w).all() and 1e-4 < top <= 3e-3, top


@pytest.mark.parametrize("act_order", [False, True], ids=["packed", "act-order-dense"])
def test_checkpoint_shards_fill_packed_buffers_or_stacks_allocated_then(
        act_order, stacks, packed_on_cpu) -> None:
    """GPTQ expert shards through FusedMoE's loader into a layer built deferred: kept INT4
    with the stacks never allocated; act-order (no kernel) dequantized into stacks allocated
    at that point, holding the checkpoint's weights."""
    from quantization import quant_checkpoints as qc

    from shoal.quantization.config import parse_quantization_config
    from shoal.quantization.formats import linear_format

    qconfig = parse_quantization_config({**GPTQ_G32, "desc_act": act_order})
    path = FastPath.plan(qconfig, torch.float32, "cpu")
    plan = path.experts_plan()
    assert plan == PackedExpertsPlan("int4")  # (a checkpoint: no random experts)
    holder = torch.nn.Module()
    with packed_experts_expected(plan):
        holder.moe = moe = FusedMoE(2, H, INTER)
    assert _never_dense(stacks)
    g = torch.Generator().manual_seed(3)
    refs = {}
    with path.loading(holder):
        for e in range(2):
            for shard, shape in (("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))):
                q = qc.gptq(torch.randn(*shape, generator=g), 4, 32, act_order=act_order)
                refs[e, shard] = q.reference
                param = moe.w2_weight if shard == "w2" else moe.w13_weight
                param.weight_loader(param, path._pack(linear_format(qconfig), "m", q.stored),
                                    e, shard)
    # the shards went to packed buffers only; act-order ones were dequantized as they came
    assert _never_dense(stacks) != act_order
    path.finish(holder)
    check_none_deferred(holder)
    if not act_order:
        assert moe.quant is not None and _never_dense(stacks)
        return
    assert moe.quant is None and not any(is_deferred(p) for p in stacks)
    want13 = torch.stack([torch.cat([refs[e, "w1"], refs[e, "w3"]]) for e in range(2)])
    torch.testing.assert_close(moe.w13_weight, want13, rtol=0, atol=1e-6)
    torch.testing.assert_close(moe.w2_weight, torch.stack([refs[e, "w2"] for e in range(2)]),
                               rtol=0, atol=1e-6)


def test_a_deferred_stack_refuses_writes_and_a_load_that_leaves_one_fails() -> None:
    with packed_experts_expected(PackedExpertsPlan("int4")):
        moe = FusedMoE(2, H, INTER)
    with pytest.raises(RuntimeError, match="single memory location"):
        moe.w13_weight.data[0].copy_(torch.ones(2 * INTER, H))
    with pytest.raises(ValueError, match="neither packed nor dense"):
        check_none_deferred(moe)
    moe.weight_loader(moe.w2_weight, torch.ones(H, INTER), 1, "w2")  # a dense shard
    assert not is_deferred(moe.w2_weight) and torch.equal(moe.w2_weight[1], torch.ones(H, INTER))
    assert is_deferred(moe.w13_weight)  # the other stack stays deferred until it is needed
