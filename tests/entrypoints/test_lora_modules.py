"""--lora-modules parsing and the served adapter table (no server: the pieces alone)."""

from __future__ import annotations

import pytest

from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.lora_routes import (
    load_startup_adapters,
    parse_lora_modules,
    runtime_updates_allowed,
)
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.lora.adapter import LoRALimits


def test_parse_lora_modules_forms() -> None:
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) \
        == [("a", "/x", None), ("b", "/y", "m")]
    for bad in ("noequals", "=/x", "a=", '{"name": "b"}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_startup_adapter_errors_name_the_module(tmp_path) -> None:
    models = ServedModels(["base"], None, 128, LoRALimits(1, 8, {}))
    with pytest.raises(ValueError, match=r"--lora-modules x=.*does not exist"):
        load_startup_adapters(models, [f"x={tmp_path / 'missing'}"])
    assert models.list().data[0].id == "base" and len(models.list().data) == 1


def test_without_enable_lora_loading_is_a_400() -> None:
    models = ServedModels(["base"], None, 128, None)
    with pytest.raises(OpenAIError) as e:
        models.load_lora("x", "/p")
    assert e.value.status == 400 and "--enable-lora" in e.value.message
    assert models.lora("base") is None and models.lora(None) is None


def test_runtime_updates_env(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("SHOAL_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not runtime_updates_allowed()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert runtime_updates_allowed()
