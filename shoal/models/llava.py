"""LLaVA (LlavaForConditionalGeneration; LLaVA-1.5 and the checkpoints shaped like it): a
CLIP or SigLIP vision tower (shoal/models/vision/clip.py) read at vision_feature_layer, a
two-layer MLP projector (linear_1, projector_hidden_act, linear_2) into the text width, and
shoal's Llama decoder (text_config llama, mistral or qwen2). One image at the tower's
trained size becomes one token per patch (plus the CLS token with the "full" feature
strategy), filling as many `<image>` positions (shoal/multimodal/processors/llava.py).

hf_config is transformers' LlavaConfig, or the engine's flattened text config whose
`multimodal_config` is that whole config (shoal/loader/multimodal_config.py). Parameter
names are transformers 5's (model.vision_tower.*, model.multi_modal_projector.*,
model.language_model.*, lm_head.*); load_weights also takes the names checkpoints are saved
under (vision_tower.[vision_model.]*, multi_modal_projector.*, language_model.model.*,
language_model.lm_head.*). q/k/v and gate/up load into fused parameters. One pipeline stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.llama import LlamaModel
from shoal.models.vision.clip import build_feature_tower
from shoal.models.vlm_common import TowerVLM, vlm_configs
from shoal.multimodal.processors.llava import image_token_id

_VISION = "model.vision_tower."
# text_config.model_type -> q/k/v projections carry a bias (Qwen2's, as Qwen2ForCausalLM)
_TEXT_QKV_BIAS = {"llama": False, "mistral": False, "qwen2": True}
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name -> this class's: checkpoints saved by transformers (old and
    new) keep `language_model.model.*`, `language_model.lm_head.*` and no `model.` before
    the tower and projector; transformers 5 loads them under `model.`."""
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith(("vision_tower.", "multi_modal_projector.", "language_model.")):
        return "model." + name
    return name


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaModel(nn.Module):
    def __init__(self, config: Any, text_config: Any, dtype: torch.dtype,
                 use_triton_ops: bool) -> None:
        super().__init__()
        vision = config.vision_config
        layer = config.vision_feature_layer
        self.vision_tower = build_feature_tower(vision, dtype, layer)
        # several feature layers are concatenated along the features
        width = vision.hidden_size * len(self.vision_tower.feature_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(
            width, text_config.hidden_size, config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)), dtype)
        text_type = getattr(text_config, "model_type", "llama")
        if text_type not in _TEXT_QKV_BIAS:
            raise ValueError(f"unsupported LLaVA text model {text_type!r}; supported: "
                             f"{', '.join(_TEXT_QKV_BIAS)}")
        self.language_model = LlamaModel(text_config, dtype, qkv_bias=_TEXT_QKV_BIAS[text_type],
                                         use_triton_ops=use_triton_ops)


class LlavaForConditionalGeneration(TowerVLM):
    label: ClassVar[str] = "LLaVA"
    vision_prefix: ClassVar[str] = _VISION

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        config, text = vlm_configs(hf_config, self.label)
        self.config = text
        self.hidden_size = text.hidden_size
        self.image_token_id = int(image_token_id(config))
        # "default" drops the CLS token (a SigLIP tower has none: its first patch goes, as
        # transformers drops it)
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
        self.drop_first = strategy == "default"
        self.model = LlavaModel(config, text, dtype, use_triton_ops)
        tied = getattr(config, "tie_word_embeddings", None)
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False)
                                        if tied is None else tied)
        self.tied_head(text, dtype)

    def text_model(self) -> nn.Module:
        return self.model.language_model

    def vision_tower(self) -> nn.Module:
        return self.model.vision_tower

    def canonical_name(self, name: str) -> str:
        return canonical_name(name)

    # ---- images -----------------------------------------------------------------------------
    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """Each feature's image(s) -> [images * tokens_per_image, hidden]. The tower runs once
        over all features of one pixel size (the image processor makes every image the
        tower's size, so usually once)."""
        if not features:
            return []
        device = self.model.language_model.embed_tokens.weight.device
        pixels = [torch.from_numpy(f.arrays()["pixel_values"].copy()) for f in features]
        out: list[torch.Tensor | None] = [None] * len(pixels)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(pixels):
            groups.setdefault(tuple(p.shape[1:]), []).append(i)
        for members in groups.values():
            embeds = self.encode_images(torch.cat([pixels[i] for i in members]).to(device))
            for i, e in zip(members, embeds.split([pixels[i].shape[0] for i in members])):
                out[i] = e.reshape(-1, e.shape[-1])
        return [e for e in out if e is not None]

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, 3, S, S] -> [n, tokens_per_image, hidden] (transformers'
        get_image_features)."""
        feats = self.model.vision_tower(pixels)
        if self.drop_first:
            feats = feats[:, 1:]
        return self.model.multi_modal_projector(feats)
