"""Qwen3.5, text only (Qwen/Qwen3.5-27B, Qwen/Qwen3.5-35B-A3B): the Qwen3-Next stack
(shoal/models/qwen3_next.py) with Qwen3.5's in-projections (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a) and dense MLPs (Qwen3_5ForCausalLM) or a shared-expert MoE in every
layer (Qwen3_5MoeForCausalLM). Its rotary is multimodal (mrope): over text alone the three
position streams are one, which is plain rotary on the first partial_rotary_factor of a head.
With images and video (the checkpoints' own Qwen3_5ForConditionalGeneration): qwen3_5_vl.py."""

from __future__ import annotations

from typing import Any, ClassVar

from shoal.models.qwen3_next import Qwen3NextForCausalLM

_SPLIT_PROJECTIONS: dict[str, tuple[str, str | int]] = {
    "in_proj_qkv": ("in_proj_qkvz", "qkv"),
    "in_proj_z": ("in_proj_qkvz", "z"),
    "in_proj_b": ("in_proj_ba", "b"),
    "in_proj_a": ("in_proj_ba", "a"),
}


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    interleaved = False
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        **Qwen3NextForCausalLM.packed_modules_mapping, **_SPLIT_PROJECTIONS}

    @staticmethod
    def sparse_layer(cfg: Any, i: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    @staticmethod
    def sparse_layer(cfg: Any, i: int) -> bool:
        return True
