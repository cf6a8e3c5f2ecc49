"""Tokenizers without the model: from a GGUF file's metadata or a folder's tokenizer files.

Kept apart from the weight loaders (and from torch): the server's frontend process needs the
tokenizer and its chat template, nothing else."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.loader.gguf_file import open_gguf
from shoal.loader.gguf_tokenizer import build_gguf_tokenizer
from shoal.loader.resolve import resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Any of these means the folder ships a tokenizer transformers can load.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    if not has_tokenizer_files(folder):
        logger.warning("model folder %s has no tokenizer files; no tokenizer loaded", folder)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """A tokenizer from a known name, a .gguf file or a folder with tokenizer files."""
    source = resolve_model(name)
    if source.kind == "gguf":
        return build_gguf_tokenizer(open_gguf(source.path))
    if not has_tokenizer_files(source.path):
        raise FileNotFoundError(f"tokenizer folder {source.path} has no tokenizer files")
    tok = load_folder_tokenizer(source.path)
    assert tok is not None  # has_tokenizer_files was checked above
    return tok


def load_frontend_tokenizer(model: str | None,
                            tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer (with its chat template) that load_model would give, read without the
    model's config or weights. None for a folder without tokenizer files (requests must
    then come as token ids)."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    source = resolve_model(model)
    if source.kind == "gguf":
        return build_gguf_tokenizer(open_gguf(source.path))
    return load_folder_tokenizer(source.path)
