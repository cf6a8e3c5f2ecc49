"""The object-valued engine arguments share one parser: JSON text or a dict, anything else a
ValueError naming the argument."""

from __future__ import annotations

import pytest

from shoal.config.speculative import SpeculativeConfig
from shoal.engine.engine_args import EngineArgs
from shoal.json_arg import json_object
from shoal.pooling.model_info import parse_pooler_config
from shoal.structured_output.params import parse_backend_config


def test_json_text_and_dicts_are_objects():
    assert json_object('{"a": 1}', "x") == {"a": 1} == json_object({"a": 1}, "x")


@pytest.mark.parametrize("bad, match", [("{nope", "x is not valid JSON"),
                                        ("[1, 2]", "x must be a dict"), (3, "x must be a dict")])
def test_anything_else_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        json_object(bad, "x")


class _Cfg:
    architectures = ["LlamaForCausalLM"]


@pytest.mark.parametrize("parse, name", [
    (parse_pooler_config, "pooler_config"),
    (SpeculativeConfig.from_user, "speculative_config"),
    (parse_backend_config, "structured_outputs_config"),
    (lambda v: EngineArgs(hf_overrides=v).apply_hf_overrides(_Cfg()), "hf_overrides"),
])
def test_each_object_argument_uses_it(parse, name):
    with pytest.raises(ValueError, match=f"{name} is not valid JSON"):
        parse("{nope")
    with pytest.raises(ValueError, match=f"{name} must be a dict"):
        parse("[1]")
