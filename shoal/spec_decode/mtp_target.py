"""Whether a target model has multi-token-prediction layers a `method="mtp"` drafter can use
(DeepSeek-V3 family and V4: num_nextn_predict_layers; Qwen3-Next and Qwen3.5:
mtp_num_hidden_layers), and how many."""

from __future__ import annotations

from typing import Any

from shoal.models.deepseek_mtp import num_mtp_layers


def mtp_layer_count(hf_config: Any) -> int:
    """MTP layers of a checkpoint: DeepSeek-V3's num_nextn_predict_layers, Qwen3-Next's and
    Qwen3.5's mtp_num_hidden_layers."""
    return num_mtp_layers(hf_config) or int(getattr(hf_config, "mtp_num_hidden_layers", 0) or 0)


def is_v4(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == "deepseek_v4"


def check_mtp_target(hf_config: Any, qwen: bool = False) -> None:
    family = qwen or hasattr(hf_config, "kv_lora_rank") or is_v4(hf_config)
    if mtp_layer_count(hf_config) < 1 or not family:
        raise ValueError(
            "speculative_config: method 'mtp' needs a model with multi-token-prediction "
            "layers (a DeepSeek-V3-family or DeepSeek-V4 config with num_nextn_predict_layers "
            ">= 1, or a Qwen3-Next / Qwen3.5 one with mtp_num_hidden_layers >= 1); "
            f"{getattr(hf_config, 'model_type', '?')} has none")
