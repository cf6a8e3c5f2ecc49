"""Pieces the vision-language models share: placing image rows into token embeddings,
loading a checkpoint whose vision tower has its own loader, the one-stage tower + decoder
model (LLaVA, Idefics3, Gemma 3), and the Qwen-VL name mapping and M-RoPE position walk.
Each model keeps its own checkpoint name mapping."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from shoal.distributed.parallel_state import get_pp_world_size
from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead
from shoal.layers.linear import load_tensor, packed_target
from shoal.layers.mrope import get_mrope
from shoal.models.llama import LlamaForCausalLM

Weights = Iterable[tuple[str, torch.Tensor]]


def place_rows(embeds: torch.Tensor, mm_embeds: torch.Tensor | None,
               is_multimodal: torch.Tensor | None) -> torch.Tensor:
    """Token embeddings with the rows under is_multimodal replaced by mm_embeds (when both
    are given)."""
    if mm_embeds is not None and is_multimodal is not None:
        embeds = embeds.index_put((is_multimodal,), mm_embeds.to(embeds.dtype))
    return embeds


def load_packed(model: nn.Module, weights: Weights,
                mapping: dict[str, tuple[str, str | int]], tied: bool) -> set[str]:
    """HF-named tensors into `model`'s parameters, fused ones through `mapping`; returns the
    names filled. Raises ValueError for a tensor without a parameter."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
            continue
        target, shard = packed_target(name, mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                             f"{type(model).__name__}")
        load_tensor(param, tensor, shard)
        loaded.add(target)
    return loaded


def split_vision(weights: Weights, prefixes: tuple[str, ...],
                 vision: list[tuple[str, torch.Tensor]],
                 rename: Callable[[str], str] = str) -> Weights:
    """The tensors of `weights` outside the vision tower (after `rename`), streamed; the
    tower's, named relative to it (the first matching prefix stripped), go to `vision`."""
    for name, tensor in weights:
        name = rename(name)
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            yield name, tensor
        else:
            vision.append((name[len(prefix):], tensor))


def vlm_configs(hf_config: Any, label: str) -> tuple[Any, Any]:
    """(the whole multimodal config, the text config) of a one-stage VLM's hf_config: the
    engine's flattened text config carries the whole one as `multimodal_config`."""
    if get_pp_world_size() > 1:
        raise NotImplementedError(f"{label} runs on one pipeline stage")
    config = getattr(hf_config, "multimodal_config", None) or hf_config
    text = hf_config if config is not hf_config else config.text_config
    return config, text


class TowerVLM(nn.Module):
    """A vision tower + projector + decoder on one pipeline stage with 1-D positions.
    Subclasses set `label`, `vision_prefix`, and in __init__ `model`, `lm_head` (tied_head)
    and `tie_word_embeddings`; they name the decoder (text_model) and the tower
    (vision_tower), and may map checkpoint names (canonical_name) and drop tower tensors
    (keep_vision)."""

    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = False
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = (
        LlamaForCausalLM.packed_modules_mapping)
    label: ClassVar[str]
    vision_prefix: ClassVar[str]
    tie_word_embeddings: bool
    lm_head: ParallelLMHead

    def text_model(self) -> nn.Module:
        raise NotImplementedError

    def vision_tower(self) -> nn.Module:
        raise NotImplementedError

    def tied_head(self, text: Any, dtype: torch.dtype) -> None:
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.text_model().embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        return place_rows(self.text_model().embed_tokens(input_ids), mm_embeds, is_multimodal)

    def get_mrope_positions(self, prompt_token_ids: list[int], features: list[Any]
                            ) -> tuple[torch.Tensor, int]:
        raise NotImplementedError(f"{self.label} uses 1-D positions (uses_mrope is False)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.text_model()(input_ids, positions, attn_metadata,
                                 inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.text_model().layers]

    def canonical_name(self, name: str) -> str:
        return name

    def keep_vision(self, name: str) -> bool:
        """Whether a tower tensor (named relative to the tower) loads."""
        return True

    def load_weights(self, weights: Weights) -> set[str]:
        """Checkpoint tensors (canonical_name): the tower's go to its own loader (its fused
        qkv), the rest through packed_modules_mapping as Llama's do. Returns the filled
        names."""
        vision: list[tuple[str, torch.Tensor]] = []
        rest = split_vision(weights, (self.vision_prefix,), vision, self.canonical_name)
        loaded = load_packed(self, rest, self.packed_modules_mapping, self.tie_word_embeddings)
        kept = [(n, t) for n, t in vision if self.keep_vision(n)]
        return loaded | {self.vision_prefix + n for n in self.vision_tower().load_weights(kept)}


# ---- Qwen-VL ----------------------------------------------------------------------------------
_QWEN_LANGUAGE = "model.language_model."
QWEN_VISION = ("model.visual.", "visual.")


def qwen_text_name(name: str) -> str:
    """transformers 5's model.language_model.* -> the decoder's model.*."""
    if name.startswith(_QWEN_LANGUAGE):
        return "model." + name[len(_QWEN_LANGUAGE):]
    return name


def install_mrope(decoder: Any, hf_config: Any, use_triton_ops: bool) -> None:
    """The decoder's own layers rotate by M-RoPE (hf_config's sections)."""
    attn = decoder.layers[decoder.start_layer].self_attn
    rope = get_mrope(hf_config, attn.head_dim, use_triton_ops)
    for layer in decoder.layers[decoder.start_layer:decoder.end_layer]:
        layer.self_attn.rotary_emb = rope


def load_qwen_vl(model: Any, weights: Weights, load_text: Callable[[Weights], set[str]]
                 ) -> set[str]:
    """A Qwen-VL checkpoint: the text tensors through load_text, the tower's (under either
    prefix of QWEN_VISION) through model.visual's loader."""
    vision: list[tuple[str, torch.Tensor]] = []
    text = ((qwen_text_name(n), t) for n, t in split_vision(weights, QWEN_VISION, vision))
    loaded = load_text(text)
    return loaded | {"visual." + n for n in model.visual.load_weights(vision)}


def mrope_walk(prompt_len: int, features: list[Any],
               place: Callable[[Any, int], tuple[np.ndarray, int]]
               ) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, prompt_len] and their delta: text runs count up on all three
    streams; place(feature, start) gives an item's [3, n] positions when the text before it
    ends at start, and where the text after it starts."""
    parts: list[np.ndarray] = []
    cursor, start = 0, 0
    for f in sorted(features, key=lambda f: f.offset):
        text = f.offset - cursor
        parts.append(np.tile(np.arange(text) + start, (3, 1)))
        grid, start = place(f, start + text)
        parts.append(grid)
        cursor = f.offset + f.length
    parts.append(np.tile(np.arange(prompt_len - cursor) + start, (3, 1)))
    positions = np.concatenate(parts, axis=1)
    delta = int(positions.max()) + 1 - prompt_len
    return torch.from_numpy(positions.astype(np.int64)), delta


@dataclass(frozen=True)
class VideoSpan:
    """A video's span as prune_video lays it out once the tower has run (EVS): the rows the
    encoder cache keeps for it [n, D], their M-RoPE positions relative to the span's first
    [3, n], and the token ids the model reads at the span's positions when they are not the
    prompt's (Qwen3-VL: the timestamps between frames sit where the kept tokens put them,
    not where the prompt planned them); None: the prompt's own ids."""

    rows: torch.Tensor
    positions: torch.Tensor
    token_ids: np.ndarray | None = None
