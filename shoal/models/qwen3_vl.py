"""Qwen3-VL (Qwen3VLForConditionalGeneration, dense): the Qwen3 decoder with interleaved
M-RoPE, and its vision tower (shoal/models/vision/qwen3_vl.py), whose merged patch features
fill the <|image_pad|> and <|video_pad|> positions of the prompt
(shoal/multimodal/processors/qwen3_vl.py expands them; a video's frames are separated by
timestamp text, which its feature's embed_mask leaves to the token embeddings; under EVS,
prune_video lays the span out once the tower has run: shoal/models/qwen3_vl_video.py).

Deepstack: the tower also yields one feature tensor per `deepstack_visual_indexes` block;
the k-th is added to the hidden states at the image positions after decoder layer k.
embed_multimodal returns them beside the main features along the last dim (D = hidden *
(1 + number of deepstack layers)); embed_input_ids places the main part and keeps the rest
for the forward that follows, which applies and drops it.

The engine's hf_config is the text config, flattened (shoal/loader/multimodal_config.py);
`multimodal_config` is the checkpoint's whole config. Tensor names: model.language_model.*,
model.visual.*, lm_head.*."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch

from shoal.models.llama import LlamaModel
from shoal.models.qwen2_5_vl import _pixels_and_grid, evs_keep_mask
from shoal.models.qwen3 import Qwen3ForCausalLM
from shoal.models.qwen3_vl_video import PrunedVideo, span_positions, span_rows
from shoal.models.vision.qwen3_vl import Qwen3VisionTransformer
from shoal.models.vlm_common import VideoSpan, install_mrope, load_qwen_vl, mrope_walk


class _DeepstackModel(LlamaModel):
    """The decoder stack with deepstack: `pending` (set by the model class) is the per-layer
    features [k, n, hidden] and the [T] mask of the rows they add to."""

    pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pending, self.pending = self.pending, None
        if pending is None:
            return super().forward(input_ids, positions, md, intermediate, inputs_embeds)
        if not (self.is_first and self.is_last):
            raise NotImplementedError("Qwen3-VL deepstack under pipeline parallelism")
        features, mask = pending
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, md)
            if i < features.shape[0]:
                # the layer's output is hidden + residual: adding to the residual rows is
                # adding to transformers' hidden states after layer i
                assert residual is not None
                residual = residual.index_put((mask,), features[i].to(residual.dtype),
                                              accumulate=True)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True
    encoder_graphs: Any = None  # set by the runner on CUDA (worker/encoder_graphs.py)

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        install_mrope(self.model, hf_config, use_triton_ops)
        vision = hf_config.multimodal_config.vision_config
        self.visual = Qwen3VisionTransformer(vision, dtype)
        self.merge = int(vision.spatial_merge_size)
        self.num_deepstack = len(vision.deepstack_visual_indexes)

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> _DeepstackModel:
        # transformers' Qwen3-VL text rotary always interleaves the streams, whatever the
        # config says; make the config agree so get_mrope builds that layout
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if rope.get("mrope_section") and not rope.get("mrope_interleaved"):
            rope["mrope_interleaved"] = True
            hf_config.rope_parameters = rope
        return _DeepstackModel(hf_config, dtype, self.qk_norm, self.qkv_bias, use_triton_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)

    # ---- images -----------------------------------------------------------------------------
    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """One tower run over all the features' patches (one attention segment per image or
        video frame group); each item's rows are [main | deepstack 0 | deepstack 1 | ...]."""
        if not features:
            return []
        device = self.model.embed_tokens.weight.device
        arrays = [_pixels_and_grid(f) for f in features]
        # (the arrays view msgpack's read-only bytes: copied once into torch)
        pixels = torch.cat([torch.from_numpy(a[0].copy()) for a in arrays])
        grids = torch.cat([torch.from_numpy(a[1].copy()).reshape(-1, 3) for a in arrays])
        replayed = None
        graphs = self.encoder_graphs  # CUDA graphs per grid (worker/encoder_graphs.py)
        if graphs is not None and grids.shape[0] == 1:  # one image, or one video's frames
            replayed = graphs.run(pixels.to(device, non_blocking=True),
                                  tuple(int(x) for x in grids[0]))
        # (grids stay on the host: the tower's plan reads them in Python)
        main, deepstack = (replayed if replayed is not None
                           else self.visual(pixels.to(device), grids))
        out = torch.cat([main, *deepstack], dim=-1)
        sizes = [int(g.prod()) // self.merge ** 2 for g in grids]
        return list(out.split(sizes))

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        self.model.pending = None
        if mm_embeds is None or is_multimodal is None:
            return embeds
        hidden = embeds.shape[-1]
        embeds = embeds.index_put((is_multimodal,), mm_embeds[:, :hidden].to(embeds.dtype))
        if self.num_deepstack and mm_embeds.shape[0]:
            rest = mm_embeds[:, hidden:hidden * (1 + self.num_deepstack)]
            stacked = rest.reshape(-1, self.num_deepstack, hidden).transpose(0, 1)
            self.model.pending = (stacked, is_multimodal)
        return embeds

    def get_mrope_positions(self, prompt_token_ids: list[int], features: list[Any]
                            ) -> tuple[torch.Tensor, int]:
        """Text runs count up on all three streams; an image's merged patches take (start,
        start + row, start + column) after the text before it, and the text after it starts
        at start + max(rows, columns). A video is that per frame group, its timestamp and
        frame-marker tokens (the span's text, off its embed_mask) counting up between them
        (transformers' Qwen3-VL get_rope_index, which splits a video's grid into frames)."""
        return mrope_walk(len(prompt_token_ids), features, self._place)

    def _place(self, f: Any, start: int) -> tuple[np.ndarray, int]:
        _, grid = _pixels_and_grid(f)
        t, h, w = (int(x) for x in np.asarray(grid).reshape(3))
        pruned = PrunedVideo.of(f, self.merge)
        if pruned is None:
            mask = f.embed_mask or bytes([1]) * f.length
            return span_positions((t, h // self.merge, w // self.merge), mask, start,
                                  f.modality)
        # EVS: the prompt's planned layout until prune_video knows the kept tokens
        positions, _, end = pruned.layout(pruned.planned_keep(), start)
        if positions.shape[1] != f.length:
            raise ValueError(f"a pruned video's span has {f.length} tokens; its grid and "
                             f"texts make {positions.shape[1]}")
        return positions, end

    def prune_video(self, feature: Any, embeds: torch.Tensor) -> VideoSpan:
        """A video's span rows from its tower output, and their positions relative to the
        span's first [3, length]. Unpruned: the output as it is (the span's pads). EVS: the
        tokens evs_keep_mask picks (over the main features) with the texts between frames
        laid out among them by what each frame kept (qwen3_vl_video.py), and the ids the
        model so reads over the span (the prompt holds the planned layout)."""
        pruned = PrunedVideo.of(feature, self.merge)
        if pruned is None:
            return VideoSpan(embeds, torch.from_numpy(self._place(feature, 0)[0]))
        hidden = embeds.shape[1] // (1 + self.num_deepstack)
        keep = evs_keep_mask(embeds[:, :hidden], pruned.grid, pruned.rate)
        positions, is_pad, _ = pruned.layout(keep.cpu().numpy(), 0)
        if len(is_pad) != feature.length:
            raise ValueError(f"a pruned video's span has {feature.length} tokens; EVS keeps "
                             f"{len(is_pad)}")
        ids = torch.from_numpy(pruned.text_ids).to(embeds.device)
        rows = span_rows(embeds[keep.to(embeds.device)], self.model.embed_tokens(ids),
                         torch.from_numpy(is_pad))
        return VideoSpan(rows, torch.from_numpy(positions),
                         pruned.span_ids(is_pad, int(self.config.video_token_id)))

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_qwen_vl(self, weights, super().load_weights)
