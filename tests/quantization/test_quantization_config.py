"""Detecting a checkpoint's quantization, the `quantization` engine argument against it, and
the errors a bad checkpoint or argument gets: each names what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import quant_checkpoints as qc
from quant_cases import CASES

from shoal import LLM
from shoal.cli import build_parser
from shoal.engine.engine_args import EngineArgs
from shoal.entrypoints.cli_args import engine_args_from
from shoal.loader import load_model
from shoal.quantization.config import (
    QuantizationConfig,
    parse_quantization_config,
    resolve_quantization,
)


def _with_config(dense: Path, out: Path, quantization_config: dict | None) -> Path:
    """The dense checkpoint's tensors under another quantization_config (only the config is
    read by the checks below)."""
    return qc.write_folder(out, dense, qc.read_tensors(dense), quantization_config)


def test_configs_parse_to_their_parameters():
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "fmt": "e4m3"})
    assert (fp8.weight_block_size, fp8.activation_scheme) == ((128, 128), "dynamic")
    gptq = parse_quantization_config({"quant_method": "gptq", "bits": 8, "group_size": 64,
                                      "desc_act": True, "sym": False,
                                      "checkpoint_format": "gptq_v2"})
    assert (gptq.bits, gptq.group_size, gptq.desc_act, gptq.sym, gptq.checkpoint_format) == \
        (8, 64, True, False, "gptq_v2")
    awq = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128,
                                     "zero_point": True, "version": "GEMM"})
    assert (awq.group_size, awq.version) == (128, "gemm")
    ct = parse_quantization_config(CASES["ct-w4a16-sym"].config)
    assert ct.quant_method == "compressed-tensors" and "pack-quantized" in ct.describe()


@pytest.mark.parametrize("raw,match", [
    ({"quant_method": "fbgemm_fp8"},
     "'fbgemm_fp8' is not supported.*fp8, compressed-tensors, gptq, awq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({"quant_method": "hqq"}, "'hqq' is not supported"),
    ({"quant_method": "made-up"}, "'made-up' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits.*4, 8"),
    ({"quant_method": "gptq", "bits": 2}, "GPTQ with 2 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "without zero points"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive ints"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": qc.ct_scheme({"num_bits": 4, "type": "float",
                                           "strategy": "tensor_group", "group_size": 16})}},
     "'nvfp4-pack-quantized' is not supported"),
    (dict(CASES["ct-w4a16-sym"].config, sparsity_config={"format": "sparse-24-bitmask"}),
     "sparsity_config"),
])
def test_unsupported_methods_are_refused_by_name(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(raw)


def test_requested_method_against_the_checkpoints():
    awq = QuantizationConfig("awq", group_size=128)
    assert resolve_quantization(None, awq, "m") is awq
    assert resolve_quantization("awq", awq, "m") is awq
    assert resolve_quantization("awq_marlin", awq, "m") is awq  # vLLM's kernel name
    with pytest.raises(ValueError, match="quantization='gptq' conflicts.*m.*'awq'"):
        resolve_quantization("gptq", awq, "m")
    assert resolve_quantization(None, None, "m") is None
    assert resolve_quantization("fp8", None, "m").online
    with pytest.raises(ValueError, match="'compressed-tensors' conflicts.*not quantized"):
        resolve_quantization("compressed-tensors", None, "m")
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int3", None, "m")


def test_conflicting_quantization_fails_at_load(dense_checkpoints, tmp_path):
    folder = _with_config(dense_checkpoints["llama"], tmp_path / "awq",
                          CASES["awq-4bit-g32"].config)
    with pytest.raises(ValueError, match="quantization='gptq' conflicts.*'awq'"):
        LLM(model=str(folder), quantization="gptq", dtype="float32")
    with pytest.raises(ValueError, match="quantization='awq' conflicts.*not quantized"):
        load_model(str(dense_checkpoints["llama"]), quantization="awq")


def test_gguf_takes_no_other_quantization(smollm_gguf):
    folder, name = smollm_gguf
    with pytest.raises(ValueError, match="quantization='awq' does not apply to the GGUF"):
        load_model(str(Path(folder) / name), quantization="awq")


def test_quantize_config_json_of_autogptq_is_read(dense_checkpoints, tmp_path):
    folder = _with_config(dense_checkpoints["llama"], tmp_path / "old", None)
    (folder / "quantize_config.json").write_text(json.dumps(
        {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}))
    from shoal.loader.safetensors_loader import load_folder_config
    from shoal.quantization.config import detect_quantization

    found = detect_quantization(load_folder_config(folder), folder)
    assert (found.quant_method, found.group_size) == ("gptq", 128)


def _quantized(dense: dict, out: Path, fmt: str) -> Path:
    case = CASES[fmt]
    return qc.quantize_folder(dense["llama"], out, case.quantize, case.config)[0]


def _without(folder: Path, name: str) -> Path:
    """A copy of the checkpoint lacking one tensor."""
    tensors = qc.read_tensors(folder)
    del tensors[name]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return qc.write_folder(folder.parent / "broken", folder, tensors, config)


@pytest.mark.parametrize("fmt,dropped,match", [
    ("fp8-block", "model.layers.1.self_attn.o_proj.weight_scale_inv",
     r"model\.layers\.1\.self_attn\.o_proj: has .*o_proj\.weight but no weight_scale_inv or "
     "weight_scale"),
    ("gptq-4bit-act-order", "model.layers.0.mlp.up_proj.g_idx", "up_proj: has .* but no g_idx"),
    ("awq-4bit-g32", "model.layers.0.mlp.down_proj.qzeros", "down_proj: has .* but no qzeros"),
    ("ct-w4a16-sym", "model.layers.0.self_attn.q_proj.weight_shape", "but no weight_shape"),
])
def test_a_missing_part_names_the_module_and_what_it_lacks(dense_checkpoints, tmp_path, fmt,
                                                          dropped, match):
    folder = _without(_quantized(dense_checkpoints, tmp_path, fmt), dropped)
    with pytest.raises(ValueError, match=match):
        LLM(model=str(folder), dtype="float32")


def test_a_quantized_module_the_config_ignores_is_an_error(dense_checkpoints, tmp_path):
    folder = _quantized(dense_checkpoints, tmp_path, "ct-w4a16-sym")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:.*layers\\.0\\.mlp.*")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\..*quantized, but the "
                                         "quantization_config ignores"):
        list(load_model(str(folder)).weights())


def test_engine_argument_and_cli_flag():
    assert EngineArgs().quantization is None
    ns = build_parser().parse_args(["serve", "m", "--quantization", "fp8"])
    assert engine_args_from(ns).quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")._check_values()


def test_compressed_tensors_groups_by_targets_and_ignore():
    """A regex target wins over the class "Linear"; ignored modules have no scheme to use."""
    from shoal.quantization.compressed_tensors import CompressedTensorsLayout

    int4 = qc.ct_scheme({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                         "group_size": 32})
    int4["targets"] = [r"re:.*mlp\.experts\.\d+\..*"]
    fp8 = CASES["ct-w8a8-fp8"].config["config_groups"]["group_0"]
    layout = CompressedTensorsLayout({
        "quant_method": "compressed-tensors", "format": "mixed-precision",
        "config_groups": {"experts": int4, "rest": fp8}, "ignore": ["lm_head"]})
    assert layout.formats == ["float-quantized", "pack-quantized"]
    assert layout.scheme_for("model.layers.1.mlp.experts.7.up_proj").format == "pack-quantized"
    assert layout.scheme_for("model.layers.1.self_attn.o_proj").format == "float-quantized"
    assert layout.is_ignored("lm_head") and not layout.is_ignored("model.lm_head_x")
