from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

# Belt and braces: nothing in the loader tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from gguf_factory import TinyModel, TinySpec, write_tiny_gguf  # noqa: E402


@pytest.fixture
def make_gguf(tmp_path: Path) -> Callable[..., TinyModel]:
    """Factory: make_gguf(name="m.gguf", **TinySpec fields) writes a tiny GGUF under tmp_path."""

    def make(name: str = "tiny.gguf", seed: int = 0, **spec_fields) -> TinyModel:
        return write_tiny_gguf(tmp_path / name, TinySpec(**spec_fields), seed=seed)

    return make


@pytest.fixture
def tiny_llama(make_gguf) -> TinyModel:
    return make_gguf()
