"""What the loader hands to the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from shoal.loader.kv_scales import KVScales

WeightsFn = Callable[[], Iterator[tuple[str, torch.Tensor]]]


def no_weights() -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a dummy load: none; the engine initializes its own."""
    return iter(())


@dataclass
class LoadedModel:
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # chat_template set when the source has one
    source: str  # human-readable path for logs and errors
    # Each call starts a fresh lazy pass over (HF parameter name, float32 tensor); a tied lm_head
    # is left out.
    weights: WeightsFn
    load_format: str = "auto"  # the format actually used: "gguf", "safetensors" or "dummy"
    # The checkpoint's KV-cache scales, taken out of `weights` as it streams (kv_scales.py)
    kv_scales: KVScales = field(default_factory=KVScales)
    # The checkpoint's quantization (or quantization="fp8" of a dense one); a dummy load's
    # too, which quantizes its random weights by it on the GPU (shoal/quantization/fast_path.py)
    quantization: Any = None

    def eos_token_ids(self) -> frozenset[int]:
        """The config's EOS id(s), else the tokenizer's."""
        eos = getattr(self.hf_config, "eos_token_id", None)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id if eos is None else eos
        return frozenset([eos] if isinstance(eos, int) else (eos or []))
