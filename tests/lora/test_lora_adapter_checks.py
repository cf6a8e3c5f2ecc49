"""What shoal reads from a PEFT folder before any request uses it (shoal/lora/adapter.py):
each way an adapter can be unusable gives a ValueError naming the problem, and the scale of
B A follows PEFT's (alpha / r, alpha / sqrt(r) with rsLoRA, per-module alpha_pattern). Also the
LoRA settings and LoRARequest's own checks. No engine: folders written by hand."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from peft_adapters import write_raw_adapter
from safetensors.torch import save_file

from shoal.config.lora import LoRAConfig
from shoal.lora.adapter import LoRALimits, check_adapter, read_adapter
from shoal.lora.request import LoRARequest

HIDDEN = 64
# The projections of a two-layer model with hidden size 64 (q, k, v of 64, 32, 32 rows).
TARGETS = {f"model.layers.{i}.self_attn.{p}": (HIDDEN, out)
           for i in range(2) for p, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32),
                                             ("o_proj", 64))}
LIMITS = LoRALimits(max_loras=2, max_lora_rank=8, targets=TARGETS)


def adapter(path: Path, **config) -> Path:
    """A good q/v adapter of rank 8, its config updated with `config` (None deletes a key)."""
    write_raw_adapter(path, TARGETS, seed=0)
    file = path / "adapter_config.json"
    cfg = json.loads(file.read_text())
    cfg.update(config)
    file.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_a_good_adapter_is_read(tmp_path):
    spec = check_adapter(str(adapter(tmp_path / "good")), LIMITS)
    assert spec.rank == 8
    assert set(spec.modules) == {n for n in TARGETS if n.endswith(("q_proj", "v_proj"))}
    q = spec.modules["model.layers.0.self_attn.q_proj"]
    assert (q.rank, q.in_features, q.out_features, q.scaling) == (8, 64, 64, 16 / 8)


@pytest.mark.parametrize("config, scale", [
    (dict(lora_alpha=32), 32 / 8),
    (dict(lora_alpha=32, use_rslora=True), 32 / math.sqrt(8)),
    (dict(lora_alpha=None), 8 / 8),  # PEFT's default alpha is 8
    # alpha_pattern matches the end of the module name at a dot, as PEFT's get_pattern_key
    (dict(lora_alpha=16, alpha_pattern={"q_proj": 4}), 4 / 8),
    (dict(lora_alpha=16, alpha_pattern={"layers.1.self_attn.q_proj": 2}), 16 / 8),
])
def test_scaling_follows_peft(config, scale, tmp_path):
    spec = read_adapter(str(adapter(tmp_path / "a", **config)))
    assert spec.modules["model.layers.0.self_attn.q_proj"].scaling == pytest.approx(scale)
    v = spec.modules["model.layers.1.self_attn.v_proj"]
    default = config.get("lora_alpha") or 8
    assert v.scaling == pytest.approx(default / (math.sqrt(8) if config.get("use_rslora")
                                                 else 8))


def test_rank_of_each_module_comes_from_its_tensors(tmp_path):
    """rank_pattern adapters: the rank check and the scale use each module's own rank."""
    path = adapter(tmp_path / "a", r=16, lora_alpha=16)
    gen = torch.Generator().manual_seed(0)
    write_tensors(path, {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
            torch.randn(4, HIDDEN, generator=gen),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
            torch.randn(64, 4, generator=gen)})
    (q,) = check_adapter(str(path), LIMITS).modules.values()  # r=16 in the config, 4 here
    assert (q.rank, q.scaling) == (4, 16 / 4)


@pytest.mark.parametrize("config, message", [
    (dict(peft_type="IA3"), "IA3 adapter; only LORA"),
    (dict(r=0), "r must be a positive integer"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_unsupported_config_is_refused(config, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        read_adapter(str(adapter(tmp_path / "a", **config)))


def test_unreadable_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_adapter(str(tmp_path / "nowhere"))
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter(str(bare))
    (bare / "adapter_config.json").write_text("{not json")
    torch.save({}, bare / "adapter_model.bin")
    with pytest.raises(ValueError, match="adapter_model.bin only.*safe_serialization"):
        read_adapter(str(bare))
    write_tensors(bare, {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="not valid JSON"):
        read_adapter(str(bare))


@pytest.mark.parametrize("tensors, message", [
    ({}, "no LoRA tensors"),
    ({"q_proj.lora_A.weight": (8, 64)}, "has no lora_B tensor"),
    ({"q_proj.lora_A.weight": (8, 64), "q_proj.lora_B.weight": (64, 4)}, r"not \[r, in\]"),
    ({"q_proj.lora_magnitude_vector": (64,)}, "DoRA magnitudes"),
    ({"q_proj.lora_embedding_A": (8, 64)}, "embedding adapters"),
])
def test_bad_tensors_are_refused(tensors, message, tmp_path):
    path = adapter(tmp_path / "a")
    prefix = "base_model.model.model.layers.0.self_attn."
    write_tensors(path, {prefix + k: torch.zeros(shape) for k, shape in tensors.items()})
    with pytest.raises(ValueError, match=message):
        read_adapter(str(path))


@pytest.mark.parametrize("name, shape, message", [
    ("model.layers.0.self_attn.q_proj", (64, 64), None),
    ("model.layers.0.self_attn.q_proj", (32, 32), "another base model"),
    ("model.layers.2.self_attn.q_proj", (64, 64), "no LoRA-capable projection"),
    ("lm_head", (64, 512), "LM head"),
    ("model.embed_tokens", (512, 64), "token embedding"),
    ("model.layers.0.mlp.experts.3.gate_proj", (64, 32), "MoE experts"),
    # transformers 5 fuses the experts into one tensor; PEFT's target_parameters adapts it
    # on the module `mlp.experts` itself
    ("model.layers.0.mlp.experts", (64, 64), "MoE experts"),
])
def test_modules_checked_against_the_model(name, shape, message, tmp_path):
    path = write_raw_adapter(tmp_path / "a", {name: shape}, seed=1,
                             leaves=(name.rsplit(".", 1)[-1],))
    if message is None:
        check_adapter(str(path), LIMITS)
        return
    with pytest.raises(ValueError, match=message):
        check_adapter(str(path), LIMITS)


def test_rank_over_the_limit_and_lora_off(tmp_path):
    path = str(write_raw_adapter(tmp_path / "a", TARGETS, seed=2, r=16))
    with pytest.raises(ValueError, match=r"rank 16 .*max_lora_rank \(8\)"):
        check_adapter(path, LIMITS)
    with pytest.raises(ValueError, match="enable_lora"):
        check_adapter(path, None)


def test_a_rewritten_folder_is_read_again(tmp_path):
    """read_adapter caches by file times: a folder saved again is not served stale."""
    path = adapter(tmp_path / "a", lora_alpha=16)
    assert read_adapter(str(path)).modules["model.layers.0.self_attn.q_proj"].scaling == 2
    file = path / "adapter_config.json"
    cfg = json.loads(file.read_text())
    file.write_text(json.dumps({**cfg, "lora_alpha": 32}))
    # (some filesystems keep times in whole seconds: move it on explicitly)
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert read_adapter(str(path)).modules["model.layers.0.self_attn.q_proj"].scaling == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_loras=0), "max_loras must be an integer >= 1"),
    (dict(max_lora_rank=4), "max_lora_rank must be one of 1, 8, 16"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras must be an integer >= max_loras \(4\)"),
])
def test_lora_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_lora_settings_are_checked_by_the_engine_args(tiny_llama_dir):
    from shoal import LLM

    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LLM(model=str(tiny_llama_dir), enable_lora=True, max_lora_rank=4, device="cpu")


@pytest.mark.parametrize("args, message", [
    (("a", 0, "/x"), "lora_int_id must be an integer >= 1"),
    (("a", True, "/x"), "lora_int_id must be an integer >= 1"),
    (("", 1, "/x"), "lora_name must be a non-empty string"),
    (("a", 1, ""), "lora_path must name"),
])
def test_lora_request_checks_itself(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)

