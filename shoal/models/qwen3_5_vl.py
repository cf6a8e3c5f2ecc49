"""Qwen3.5 with images and video (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration: the Qwen/Qwen3.5-* repos): the hybrid decoder of
qwen3_5.py (Gated DeltaNet layers beside gated full attention) under Qwen3-VL's vision
front end.

What differs from Qwen3-VL (transformers 5.25's modeling_qwen3_5.py):
- the tower is Qwen3-VL's without deepstack (no deepstack_visual_indexes, no deepstack
  mergers): its merged tokens alone fill the <|image_pad|> / <|video_pad|> rows, so
  shoal/models/vision/qwen3_vl.py runs it with an empty deepstack list;
- M-RoPE (interleaved t, h, w) rotates only the partial_rotary_factor of each head, and only
  in the full-attention layers; the linear-attention layers take no positions at all;
- the positions themselves are Qwen3-VL's (a video split into its frame groups, timestamp
  text counting up between them), so the position walk, the tower's batching and EVS
  (video_pruning_rate) are Qwen3-VL's methods, borrowed below.

The prompt side is Qwen3-VL's processor (transformers maps qwen3_5 and qwen3_5_moe to
Qwen3VLProcessor): shoal/multimodal/processors/qwen3_vl.py. Tensor names:
model.language_model.*, model.visual.*, lm_head.* (mtp.* skipped, as the text model does).
Served without its tower (language-model-only) the checkpoint loads as qwen3_5.py's class
instead (shoal/loader/text_only.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from shoal.layers.mrope import get_mrope
from shoal.models.qwen3_5 import Qwen3_5ForCausalLM
from shoal.models.qwen3_next import partial_rotary_factor
from shoal.models.qwen3_vl import Qwen3VLForConditionalGeneration as _Qwen3VL
from shoal.models.vision.qwen3_vl import Qwen3VisionTransformer
from shoal.models.vlm_common import load_qwen_vl, place_rows

# transformers' Qwen3.5 text rotary takes this when rope_parameters has no mrope_section
_DEFAULT_MROPE_SECTION = [11, 11, 10]


def _interleaved_mrope(hf_config: Any) -> None:
    """transformers' Qwen3.5 text rotary always interleaves the three streams and falls back
    to [11, 11, 10] sections: make the config say so, for get_mrope."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope.setdefault("mrope_section", list(_DEFAULT_MROPE_SECTION))
    rope["mrope_interleaved"] = True
    hf_config.rope_parameters = rope


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True
    num_deepstack = 0  # (the borrowed Qwen3-VL methods read it)
    encoder_graphs: Any = None  # set by the runner on CUDA (worker/encoder_graphs.py)

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        _interleaved_mrope(hf_config)
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        for layer in self.model.layers:
            if not layer.linear:
                attn = layer.self_attn
                rot = int(attn.head_dim * partial_rotary_factor(hf_config))
                attn.rotary_emb = get_mrope(hf_config, attn.head_dim, use_triton_ops,
                                            rot_dim=rot)
        vision = hf_config.multimodal_config.vision_config
        if getattr(vision, "deepstack_visual_indexes", None):
            raise ValueError("Qwen3.5's vision_config has no deepstack_visual_indexes (got "
                             f"{vision.deepstack_visual_indexes}); is this a Qwen3-VL "
                             "checkpoint?")
        self.visual = Qwen3VisionTransformer(vision, dtype)
        self.merge = int(vision.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        return place_rows(self.model.embed_tokens(input_ids), mm_embeds, is_multimodal)

    # Qwen3-VL's: one tower run over the step's items, the M-RoPE walk (frame groups and
    # the texts between them), EVS's layout of a pruned video; with no deepstack each item's
    # rows are the merged tokens alone (D = hidden_size)
    embed_multimodal = _Qwen3VL.embed_multimodal
    get_mrope_positions = _Qwen3VL.get_mrope_positions
    _place = _Qwen3VL._place
    prune_video = _Qwen3VL.prune_video

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_qwen_vl(self, weights, super().load_weights)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    @staticmethod
    def sparse_layer(cfg: Any, i: int) -> bool:
        return True
