"""Load a transformers-style folder: config.json and *.safetensors (its tokenizer files:
shoal/loader/tokenizers.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from shoal.loader.loaded_model import WeightsFn

logger = logging.getLogger(__name__)

def load_folder_config(folder: Path) -> PretrainedConfig:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    # local_files_only keeps transformers from treating the path as a hub repo id
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
    hint = (
        f" (found {', '.join(pickled)}: pickled checkpoints are not loaded, "
        f"convert them to safetensors)"
        if pickled
        else ""
    )
    raise FileNotFoundError(f"model folder {folder} has no *.safetensors weights{hint}")


def folder_weights(folder: Path, config: PretrainedConfig,
                   rename: Callable[[str], str | None] | None = None,
                   dtype: torch.dtype | None = torch.float32,
                   keep_integers: bool = False) -> WeightsFn:
    """rename: the name a tensor loads as (None: skipped), e.g. a multimodal checkpoint's
    language model read on its own (loader/text_only.py). dtype None: tensors as stored (a
    quantized checkpoint's, for shoal/quantization to dequantize). keep_integers: integer
    tensors as stored (gpt-oss's MXFP4 bytes, which the model unpacks: in float32 they
    would take four times their size)."""
    files = safetensors_files(folder)
    # A tied head is the embedding matrix; some checkpoints store the copy anyway, so drop it.
    skip = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for stored in handle.keys():
                    name = rename(stored) if rename is not None else stored
                    if name is None or name in skip:
                        continue
                    tensor = handle.get_tensor(stored)
                    as_stored = dtype is None or (keep_integers
                                                  and not tensor.is_floating_point())
                    yield name, tensor if as_stored else tensor.to(dtype)

    return weights
