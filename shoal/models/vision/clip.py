"""The CLIP vision transformer as LLaVA reads it: a patch-embedding conv (no bias), a class
token, learned position embeddings, `pre_layrnorm`, then pre-LN encoder layers (bidirectional
attention, quick_gelu MLP by default). LLaVA takes the hidden states of an inner layer
(vision_feature_layer, -2 by default: the input of the last layer), never the final
post_layernorm, so the tower builds only the layers that feed the wanted states.

The encoder layer is SigLIP's (shoal/models/vision/siglip.py): the same math and parameter
names, with q/k/v fused into one `qkv_proj`. Parameter names are transformers' CLIPVisionModel
(embeddings.*, pre_layrnorm.*, encoder.layers.N.*); load_weights takes the checkpoint's names
under that prefix, with or without the older `vision_model.` level. SiglipFeatureTower is
the same for a LLaVA whose tower is SigLIP (no class token, no pre_layrnorm)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from shoal.models.vision.siglip import SiglipEncoderLayer, SiglipVisionEmbeddings, load_qkv_fused

# never run for LLaVA: the final norm and SigLIP's attention-pooling head
_NEVER_RUN = ("post_layernorm.", "head.")


def feature_layer_indices(layer: int | Sequence[int], num_layers: int) -> list[int]:
    """vision_feature_layer (one index or several, negative from the end, as into
    transformers' hidden_states) -> indices 0..num_layers, where 0 is the encoder's input
    and i the output of layer i."""
    layers = [layer] if isinstance(layer, int) else list(layer)
    out = [i if i >= 0 else num_layers + 1 + i for i in layers]
    if not out or any(not 0 <= i <= num_layers for i in out):
        raise ValueError(f"vision_feature_layer {layer!r} is outside the {num_layers + 1} "
                         "hidden states of the vision tower")
    return out


def hidden_states_at(x: torch.Tensor, layers: Iterable[nn.Module], wanted: list[int]
                     ) -> torch.Tensor:
    """Runs the encoder layers over x [n, L, D] only as far as the deepest wanted state;
    returns the wanted states (feature_layer_indices) concatenated along the last dim, as
    transformers' LLaVA concatenates several feature layers."""
    states: dict[int, torch.Tensor] = {0: x}
    deepest = max(wanted)
    for i, layer in enumerate(layers, start=1):
        if i > deepest:
            break
        x = layer(x, None)  # no key mask: every patch of a CLIP/SigLIP image is real
        states[i] = x
    return torch.cat([states[i] for i in wanted], dim=-1)


def canonical_tower_name(name: str) -> str:
    """Drops the `vision_model.` level older checkpoints keep (transformers' CLIPVisionModel
    and SiglipVisionModel have flattened it away)."""
    return name[len("vision_model."):] if name.startswith("vision_model.") else name


def layer_index(name: str) -> int | None:
    """N of an `encoder.layers.N.*` name, else None."""
    if not name.startswith("encoder.layers."):
        return None
    return int(name.split(".", 3)[2])


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d, self.patch_size = cfg.hidden_size, int(cfg.patch_size)
        self.image_size = int(cfg.image_size)
        self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, self.patch_size,
                                         stride=self.patch_size, bias=False, dtype=dtype)
        num_positions = (self.image_size // self.patch_size) ** 2 + 1  # patches and CLS
        self.position_embedding = nn.Embedding(num_positions, d, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, C, S, S] at the trained size S -> [n, 1 + (S/p)^2, D]: CLS, then the patches
        row by row. Other sizes would need interpolated positions, which LLaVA never uses."""
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"a {h} x {w} image for a CLIP tower trained on "
                             f"{self.image_size} x {self.image_size}")
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embedding.weight[None]


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg, dtype) for _ in range(num_layers))


class VisionFeatureTower(nn.Module):
    """What the CLIP and SigLIP towers share: the feature layers they stop at and a loader
    that skips what is never run (layers past the deepest feature layer, post_layernorm,
    SigLIP's pooling head)."""

    feature_layers: list[int]
    encoder: CLIPEncoder

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors named as under transformers' vision_tower (q/k/v into the
        fused qkv_proj); returns the names of the parameters filled."""
        built = len(self.encoder.layers)

        def kept() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = canonical_tower_name(name)
                index = layer_index(name)
                if not (name.startswith(_NEVER_RUN) or (index is not None and index >= built)):
                    yield name, tensor

        return load_qkv_fused(self, kept(), f"the vision tower ({type(self).__name__})")


class CLIPVisionTransformer(VisionFeatureTower):
    """Images [n, C, S, S] -> the hidden states at `feature_layers` ([n, 1 + L, D * k],
    the CLS token first)."""

    has_cls = True

    def __init__(self, cfg: Any, dtype: torch.dtype, feature_layers: list[int]) -> None:
        """feature_layers: feature_layer_indices of the wanted states; layers past the
        deepest are not built."""
        super().__init__()
        self.feature_layers = feature_layers
        self.embeddings = CLIPVisionEmbeddings(cfg, dtype)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(cfg, dtype, max(feature_layers))
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values.to(self.pre_layrnorm.weight.dtype))
        return hidden_states_at(self.pre_layrnorm(x), self.encoder.layers, self.feature_layers)


class SiglipFeatureTower(VisionFeatureTower):
    """SigLIP as a LLaVA tower: no CLS token, no pre-LN; images at the trained size only
    (so positions are 0..L-1, not Idefics3's bucketed ones) -> [n, L, D * k]."""

    has_cls = False

    def __init__(self, cfg: Any, dtype: torch.dtype, feature_layers: list[int]) -> None:
        super().__init__()
        self.feature_layers = feature_layers
        self.image_size = int(cfg.image_size)
        self.embeddings = SiglipVisionEmbeddings(cfg, dtype)
        self.encoder = CLIPEncoder(cfg, dtype, max(feature_layers))
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"a {h} x {w} image for a SigLIP tower trained on "
                             f"{self.image_size} x {self.image_size}")
        emb = self.embeddings
        x = emb.patch_embedding(pixel_values.to(emb.position_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2) + emb.position_embedding.weight[None]
        return hidden_states_at(x, self.encoder.layers, self.feature_layers)


def build_feature_tower(cfg: Any, dtype: torch.dtype, feature_layer: int | Sequence[int]
                        ) -> VisionFeatureTower:
    """The tower for a vision_config (clip_vision_model or siglip_vision_model) that stops
    at vision_feature_layer."""
    layers = feature_layer_indices(feature_layer, int(cfg.num_hidden_layers))
    towers: dict[str, type[CLIPVisionTransformer | SiglipFeatureTower]] = {
        "clip_vision_model": CLIPVisionTransformer, "siglip_vision_model": SiglipFeatureTower}
    cls = towers.get(getattr(cfg, "model_type", ""))
    if cls is None:
        raise ValueError(f"unsupported vision tower {cfg.model_type!r}; supported: "
                         f"{', '.join(towers)}")
    return cls(cfg, dtype, layers)
