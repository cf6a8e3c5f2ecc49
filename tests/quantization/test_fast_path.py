"""The GPU fast path's load side, run on the CPU (Triton kernels in the interpreter,
torch._scaled_mm on its CPU kernel): each format's tensors in the packed layout equal the
test quantizer's reference weight; a tiny Llama loads a quantized checkpoint packed through
its own fused weight loaders (q/k/v, gate/up) and every linear then computes what the dense
twin computes; dummy weights quantize at finish; what cannot be packed is refused clearly."""

from __future__ import annotations

import logging

import pytest
import quant_checkpoints as qc
import torch
from quant_cases import CASES
from test_quantized_checkpoints import write_pair

from shoal.layers.quantization.fp8_quant import quantize_fp8_groups_reference
from shoal.layers.quantization.methods import (
    FP8BlockLinear,
    FP8ScaledMM,
    Int4Linear,
    make_quant_linear,
)
from shoal.loader import load_model
from shoal.models.registry import resolve_model_class
from shoal.quantization.config import parse_quantization_config
from shoal.quantization.fast_path import DEQUANT_ENV, FastPath, fast_layers, packed_of
from shoal.quantization.formats import linear_format
from shoal.quantization.packed import dequantize_packed

CPU = torch.device("cpu")
PACKED = ("fp8-block", "fp8-channel-static", "gptq-4bit-g32", "gptq-4bit-act-order",
          "awq-4bit-g32", "ct-w4a16-sym", "ct-w4a16-asym", "ct-w8a8-fp8")
DEQUANTIZED = ("gptq-8bit-asym-v2", "ct-w8a8-int8", "ct-w8a16-naive")


def reference_output(q, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the layer computes in plain PyTorch: activations rounded to FP8 as the method
    rounds them (per token, per token-group or by the static scale), weights dequantized."""
    if isinstance(q, FP8ScaledMM) and q.input_scale is not None:
        s = q.input_scale
        x = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    elif isinstance(q, (FP8ScaledMM, FP8BlockLinear)):
        group = x.shape[1] if isinstance(q, FP8ScaledMM) else q.group
        xq, s = quantize_fp8_groups_reference(x, group)
        x = xq.float() * s.repeat_interleave(group, 1)[:, :x.shape[1]]
    return x @ weight.t()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-6, (err, want.abs().max().item())


def _stored(case_name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor, object]:
    case = CASES[case_name]
    q = case.quantize(w)
    qconfig = parse_quantization_config(case.config)
    return q.stored, q.reference, qconfig


@pytest.mark.parametrize("fmt", PACKED + DEQUANTIZED)
def test_each_format_packs_to_its_reference_and_runs_packed(fmt):
    torch.manual_seed(0)
    stored, ref, qconfig = _stored(fmt, torch.randn(48, 96))
    packed = packed_of(linear_format(qconfig, keep_input_scales=True), qconfig,
                       "model.layers.0.mlp.up_proj", stored)
    if fmt in DEQUANTIZED:  # 8-bit weights and INT8 W8A8: no kernel here, dequantized at load
        assert packed is None
        return
    assert torch.allclose(dequantize_packed(packed), ref, rtol=0, atol=1e-6)
    q = make_quant_linear(packed, CPU)
    assert isinstance(q, FP8BlockLinear if fmt == "fp8-block" else
                      FP8ScaledMM if fmt.startswith(("fp8", "ct-w8a8")) else Int4Linear)
    x = torch.randn(5, 96)
    _close(q(x), reference_output(q, x, ref))
    if fmt == "gptq-4bit-act-order":
        assert q.perm is not None


def test_large_m_can_take_the_dequantize_then_matmul_path(monkeypatch):
    monkeypatch.setenv("SHOAL_W4A16_DENSE_ABOVE_M", "4")
    stored, ref, qconfig = _stored("gptq-4bit-act-order", torch.randn(32, 64))
    q = make_quant_linear(packed_of(linear_format(qconfig), qconfig, "m", stored), CPU)
    assert q.dense_above_m == 4
    x = torch.randn(9, 64)
    _close(q(x), x @ ref.t())


def _load(folder, qconfig_arg=None, fast: bool = True):
    loaded = load_model(str(folder), quantization=qconfig_arg)
    model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32,
                                                  use_triton_ops=False)
    path = FastPath.plan(loaded.quantization, torch.float32, CPU, allow_cpu=True) \
        if fast else None
    if path is None:
        model.load_weights(loaded.weights())
        return model, None
    with path.loading(model):
        model.load_weights(path.weights(loaded.weights)())
    return model, path.finish(model)


@pytest.mark.parametrize("fmt", ["gptq-4bit-act-order", "awq-4bit-g32", "ct-w4a16-asym",
                                 "fp8-block", "fp8-channel-static", "online-fp8"])
def test_tiny_llama_loads_packed_through_its_fused_loaders(fmt, dense_checkpoints, tmp_path):
    case = CASES[fmt]
    quant, dense = write_pair("llama", case, dense_checkpoints, tmp_path)
    model, counts = _load(quant, case.quantization)
    twin, _ = _load(dense, fast=False)
    twins = dict(twin.named_modules())
    packed = {n: m for n, m in model.named_modules() if getattr(m, "quant", None) is not None}
    # every projection of both decoder layers: qkv, o, gate_up, down
    assert len(packed) == 8 and sum(counts.values()) == 8, counts
    torch.manual_seed(3)
    for name, layer in packed.items():
        assert layer.weight.numel() == 0  # the dense copy is freed
        x = torch.randn(3, twins[name].weight.shape[1])
        _close(layer(x), reference_output(layer.quant, x, twins[name].weight), 1e-4)


def test_dummy_weights_are_quantized_by_the_configs_scheme(dense_checkpoints):
    loaded = load_model(str(dense_checkpoints["llama"]), load_format="dummy")
    qconfig = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                         "sym": False})
    model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32,
                                                  use_triton_ops=False)
    torch.manual_seed(4)
    for m in fast_layers(model).values():
        m.weight.data.normal_()
    dense = {n: m.weight.detach().clone() for n, m in fast_layers(model).items()}
    path = FastPath.plan(qconfig, torch.float32, CPU, dummy=True, allow_cpu=True)
    counts = path.finish(model)
    assert counts == {"int4 g32 asym (Triton W4A16)": 8}
    for name, layer in model.named_modules():
        if name not in dense:
            continue
        x = torch.randn(2, dense[name].shape[1])
        want = x @ layer.quant.dequantize(torch.float32)
        _close(layer(x), want)
        # and that is the dense weight to 4-bit precision (garbage would be off by ~100%)
        exact = x @ dense[name].t()
        assert (want - exact).norm() < 0.2 * exact.norm()


def test_plan_is_off_on_the_cpu_and_under_the_dequantize_switch(monkeypatch):
    qconfig = parse_quantization_config({"quant_method": "fp8"})
    assert FastPath.plan(qconfig, torch.bfloat16, "cpu") is None
    assert FastPath.plan(None, torch.bfloat16, "cpu", allow_cpu=True) is None
    monkeypatch.setenv(DEQUANT_ENV, "1")
    assert FastPath.plan(qconfig, torch.bfloat16, "cpu", allow_cpu=True) is None


def test_a_packed_weight_no_loader_saw_is_an_error():
    stored, _, qconfig = _stored("gptq-4bit-g32", torch.randn(32, 64))
    path = FastPath.plan(qconfig, torch.float32, CPU, allow_cpu=True)
    fmt = linear_format(qconfig)
    stand_in = path._pack(fmt, "model.layers.0.mlp.up_proj", stored)
    assert stand_in.shape == (32, 64)
    with pytest.raises(ValueError, match="never reached a weight loader.*SHOAL_QUANT_DEQUANT"):
        path.finish(torch.nn.Linear(2, 2))


def test_a_stand_in_reaching_a_plain_parameter_is_loaded_dequantized():
    """A layer that cannot run packed (here: a plain parameter) gets the dense weight."""
    stored, ref, qconfig = _stored("awq-4bit-g32", torch.randn(32, 64))
    path = FastPath.plan(qconfig, torch.float32, CPU, allow_cpu=True)
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.zeros(32, 64), requires_grad=False)
    stand_in = path._pack(linear_format(qconfig), "holder", stored)
    with path.loading(holder):
        holder.w.weight_loader(holder.w, stand_in)
    assert path.finish(holder) == {}
    assert torch.allclose(holder.w, ref, atol=1e-6)
    assert qc.E4M3_MAX == 448.0


def test_engine_generates_with_packed_layers_as_with_the_dense_twin(
        dense_checkpoints, tmp_path, monkeypatch, caplog):
    """shoal.LLM end to end with the fast path let onto the CPU (its kernels interpreted):
    greedy tokens of the packed GPTQ act-order model equal its dequantized twin's up to a
    near tie."""
    from test_quantized_checkpoints import assert_tokens_match_up_to_a_near_tie, greedy

    plan = FastPath.plan.__func__
    monkeypatch.setattr(FastPath, "plan", classmethod(
        lambda cls, q, dtype, device, dummy=False, allow_cpu=False:
        plan(cls, q, dtype, device, dummy, True)))
    quant, dense = write_pair("llama", CASES["gptq-4bit-act-order"], dense_checkpoints,
                              tmp_path)
    with caplog.at_level(logging.INFO, logger="shoal.quantization.fast_path"):
        got = greedy(quant)
    assert "int4 g32 sym, act-order (Triton W4A16) x8" in caplog.text
    monkeypatch.undo()
    assert_tokens_match_up_to_a_near_tie(got, greedy(dense), exact=False)


def test_sleep_keeps_packed_weights_and_updates_are_refused(dense_checkpoints, tmp_path,
                                                            monkeypatch):
    """Packed layers through the RL lifecycle: sleep frees the packed tensors' storage too and
    wake brings them back (same greedy tokens); a weight update, which cannot reach them, is a
    ValueError naming the switch."""
    from shoal import LLM, SamplingParams

    plan = FastPath.plan.__func__
    monkeypatch.setattr(FastPath, "plan", classmethod(
        lambda cls, q, dtype, device, dummy=False, allow_cpu=False:
        plan(cls, q, dtype, device, dummy, True)))
    quant, _ = write_pair("llama", CASES["gptq-4bit-act-order"], dense_checkpoints, tmp_path)
    llm = LLM(model=str(quant), dtype="float32", block_size=16, num_gpu_blocks_override=64,
              max_model_len=128)
    runner = llm.llm_engine.core.runner
    packed = [m.quant for m in runner.model.modules() if getattr(m, "quant", None) is not None]
    assert packed
    codes = next(v for v in vars(packed[0]).values() if isinstance(v, torch.Tensor))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 17, 33, 2, 71]}
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(1)
    assert codes.untyped_storage().nbytes() == 0
    llm.wake_up()
    assert codes.untyped_storage().nbytes() > 0
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="SHOAL_QUANT_DEQUANT"):
        llm.update_weights([])
