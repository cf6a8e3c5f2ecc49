"""Every checkpoint format the end-to-end tests write: how to quantize a linear weight and the
quantization_config that describes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import quant_checkpoints as qc
import torch

# Kimi-K2 Thinking's layout: routed experts int4 (group 32), attention, shared experts,
# dense MLPs and the head left in bfloat16.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|down)_proj.*"]


@dataclass(frozen=True)
class Case:
    quantize: Callable[[torch.Tensor], qc.Quantized] | None  # None: online (dense on disk)
    config: dict | None  # quantization_config
    w8a8: bool = False  # activations quantized too on a GPU; here the same computation
    ignore: tuple[str, ...] = ("lm_head",)  # compressed-tensors: modules left dense
    quantization: str | None = None  # the engine argument


def _with_input_scale(q: qc.Quantized) -> qc.Quantized:
    """A static-activation FP8 checkpoint's extra tensor (unused when dequantizing)."""
    q.stored["input_scale"] = torch.tensor(0.02)
    return q


def _ct(weights: dict, fmt: str, inputs: dict | None = None, **kw) -> Case:
    scheme = qc.ct_scheme(weights, inputs)
    ignore = kw.pop("ignore", ("lm_head",))
    config = {"quant_method": "compressed-tensors", "format": fmt,
              "quantization_status": "compressed", "config_groups": {"group_0": scheme},
              "ignore": list(ignore), "kv_cache_scheme": None}
    return Case(lambda w: qc.ct_quantize(w, scheme, fmt), config, ignore=tuple(ignore), **kw)


_INT4_G32 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
             "group_size": 32}
_TOKEN = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}

CASES: dict[str, Case] = {
    "fp8-block": Case(lambda w: qc.fp8_block(w, (32, 32)),
                      {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [32, 32]}, w8a8=True),
    "fp8-channel-static": Case(lambda w: _with_input_scale(qc.fp8_rows(w)),
                               {"quant_method": "fp8", "activation_scheme": "static"},
                               w8a8=True),
    "gptq-4bit-g32": Case(lambda w: qc.gptq(w, 4, 32),
                          {"quant_method": "gptq", "bits": 4, "group_size": 32,
                           "desc_act": False, "sym": True}),
    "gptq-4bit-act-order": Case(lambda w: qc.gptq(w, 4, 32, act_order=True),
                                {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                 "desc_act": True, "sym": True}),
    "gptq-8bit-asym-v2": Case(lambda w: qc.gptq(w, 8, -1, sym=False, v1=False),
                              {"quant_method": "gptq", "bits": 8, "group_size": -1,
                               "desc_act": False, "sym": False,
                               "checkpoint_format": "gptq_v2"}),
    "awq-4bit-g32": Case(lambda w: qc.awq(w, 32),
                         {"quant_method": "awq", "bits": 4, "group_size": 32,
                          "zero_point": True, "version": "gemm"}),
    "ct-w4a16-sym": _ct(_INT4_G32, "pack-quantized"),
    "ct-w4a16-asym": _ct(dict(_INT4_G32, symmetric=False), "pack-quantized"),
    "ct-w8a8-int8": _ct({"num_bits": 8, "type": "int", "symmetric": True,
                         "strategy": "channel"}, "int-quantized", dict(_TOKEN, type="int"),
                        w8a8=True),
    "ct-w8a8-fp8": _ct({"num_bits": 8, "type": "float", "symmetric": True,
                        "strategy": "channel"}, "float-quantized", dict(_TOKEN, type="float"),
                       w8a8=True),
    "ct-w8a16-naive": _ct({"num_bits": 8, "type": "int", "symmetric": True,
                           "strategy": "channel"}, "naive-quantized"),
    "online-fp8": Case(None, None, w8a8=True, quantization="fp8"),
}
# DeepSeek-V3 with compressed-tensors: Kimi-K2 Thinking's own layout.
KIMI_K2 = _ct(_INT4_G32, "pack-quantized", ignore=KIMI_IGNORE)


def case_for(model: str, fmt: str) -> Case:
    return KIMI_K2 if model == "deepseek_v3" and fmt == "ct-w4a16-sym" else CASES[fmt]
