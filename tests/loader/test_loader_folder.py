"""transformers-style folders (config.json + *.safetensors), load_format handling, tokenizer=."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from shoal.loader import load_model

TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=100,
    tie_word_embeddings=True,
)


def _write_folder(folder: Path, *, weights: bool = True) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**TINY_LLAMA).save_pretrained(folder)
    tensors = {
        "model.embed_tokens.weight": torch.randn(100, 32, dtype=torch.float16),
        "model.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(100, 32),  # stored although tied
    }
    if weights:
        # two shards, as large checkpoints come
        save_file(
            {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]},
            str(folder / "model-00001-of-00002.safetensors"),
        )
        save_file(
            {k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"},
            str(folder / "model-00002-of-00002.safetensors"),
        )
    return tensors


def test_folder_weights_are_float32_and_skip_tied_head(tmp_path: Path):
    tensors = _write_folder(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.load_format == "safetensors"
    assert loaded.hf_config.model_type == "llama"
    assert loaded.tokenizer is None  # the folder has no tokenizer files
    weights = dict(loaded.weights())
    assert set(weights) == {"model.embed_tokens.weight", "model.norm.weight"}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, tensors[name].float())


def test_minilm_embedded_folder():
    loaded = load_model("sentence-transformers/all-MiniLM-L6-v2")
    config = loaded.hf_config
    assert config.model_type == "bert"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (384, 6, 30522)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("Hello world") == [101, 7592, 2088, 102]
    weights = dict(loaded.weights())
    assert weights["embeddings.word_embeddings.weight"].shape == (30522, 384)
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_missing_config_names_folder(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="config.json") as info:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_missing_weights_names_folder(tmp_path: Path):
    _write_folder(tmp_path, weights=False)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="safetensors") as info:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)
    assert "pytorch_model.bin" in str(info.value)


def test_dummy_accepts_config_only_folder(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY_LLAMA}))
    loaded = load_model(str(tmp_path), load_format="dummy")
    assert loaded.load_format == "dummy"
    assert loaded.hf_config.hidden_size == 32
    assert list(loaded.weights()) == []


def test_tokenizer_override_by_name(tmp_path: Path):
    _write_folder(tmp_path)
    loaded = load_model(str(tmp_path), tokenizer="all-MiniLM-L6-v2", load_format="dummy")
    assert loaded.tokenizer.encode("Hello world") == [101, 7592, 2088, 102]


def test_tokenizer_override_from_gguf(tmp_path: Path, tiny_llama):
    _write_folder(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), tokenizer=str(tiny_llama.path))
    assert loaded.tokenizer.eos_token == "<|im_end|>"


def test_tokenizer_override_without_tokenizer_files(tmp_path: Path):
    _write_folder(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_model(str(tmp_path / "m"), tokenizer=str(tmp_path / "m"))


def test_load_format_mismatches(tmp_path: Path, tiny_llama):
    _write_folder(tmp_path / "m")
    with pytest.raises(ValueError, match="load_format='gguf'"):
        load_model(str(tmp_path / "m"), load_format="gguf")
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        load_model(str(tiny_llama.path), load_format="safetensors")
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(str(tmp_path / "m"), load_format="pt")
