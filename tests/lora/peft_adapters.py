"""Random PEFT LoRA adapters over tiny random checkpoints, and PEFT itself as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, path: Path, *, seed: int, r: int = 8, alpha: float = 16,
                  targets: list[str] | None = None, use_rslora: bool = False,
                  scale: float = 0.3, **config) -> Path:
    """A PEFT adapter folder of the base checkpoint, with random A and B (PEFT starts B at
    zero, which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL, lora_dropout=0.0,
                     use_rslora=use_rslora, **config)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(path, safe_serialization=True)
    return path


def peft_model(base: Path, adapter: Path | None):
    """transformers' model of the base checkpoint with the adapter applied (None: the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is None:
        return model.eval()
    return PeftModel.from_pretrained(model, adapter).eval()


def write_raw_adapter(path: Path, targets: dict[str, tuple[int, int]], *, seed: int,
                      r: int = 8, alpha: float = 16, leaves: tuple[str, ...] = ("q_proj", "v_proj"),
                      scale: float = 0.05) -> Path:
    """A PEFT-format adapter written directly (no PEFT, no base model in memory) for the
    projections `targets` lists (an engine's limits.lora.targets: name -> (in, out)) whose
    names end in one of `leaves`."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (n_in, n_out) in targets.items():
        if name.rsplit(".", 1)[-1] not in leaves:
            continue
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) * scale
        tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
              "target_modules": sorted(set(leaves)), "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
