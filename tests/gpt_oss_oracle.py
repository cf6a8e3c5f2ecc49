"""transformers as GPT-OSS's oracle across versions: before 5.2x its experts hard-code the
clamped SwiGLU's alpha 1.702 and limit 7.0 and ignore the config's swiglu_alpha /
swiglu_limit (the GPU image's 5.17 does). The tests set a small limit so the clamps matter;
this puts the config's values into the oracle's experts, so every version computes the
model the config describes."""

from __future__ import annotations

from torch import nn


def follow_config_swiglu(model: nn.Module, config) -> nn.Module:
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            module.alpha = getattr(config, "swiglu_alpha", 1.702)
            module.limit = getattr(config, "swiglu_limit", 7.0)
    return model
