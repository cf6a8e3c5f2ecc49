"""The model's generation_config.json as vLLM reads it: sampling defaults for requests that
leave them unset (generate without params, get_default_sampling_params), --generation-config
vllm / a folder, overrides, and its extra EOS ids as stop tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_helpers import random_prompts, tiny_llm

from shoal import SamplingParams
from shoal.engine.engine_args import EngineArgs
from shoal.engine.generation_defaults import (
    GenerationDefaults,
    read_generation_defaults,
    with_generation_eos,
)

EOS = frozenset({2})


def _folder(tmp_path: Path, **fields) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, **fields}))
    return tmp_path


def test_sampling_fields_become_defaults_under_their_sampling_params_names(tmp_path):
    folder = _folder(tmp_path, temperature=0.6, top_p=0.95, top_k=20, do_sample=True,
                     max_new_tokens=64, eos_token_id=[2, 7, 9])
    d = read_generation_defaults("auto", folder, None, EOS)
    assert d.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert d.eos_token_ids == {7, 9}  # beyond the model's own EOS


def test_vllm_ignores_the_sampling_fields_but_keeps_the_eos_ids(tmp_path):
    folder = _folder(tmp_path, temperature=0.6, eos_token_id=[2, 7])
    d = read_generation_defaults("vllm", folder, None, EOS)
    assert d.sampling == {} and d.eos_token_ids == {7}
    d = read_generation_defaults("vllm", folder, {"temperature": 0.2}, EOS)
    assert d.sampling == {"temperature": 0.2}  # overrides apply under every setting


def test_a_folder_setting_and_overrides_on_top(tmp_path):
    (tmp_path / "other").mkdir()
    other = _folder(tmp_path / "other", repetition_penalty=1.1, min_p=0.05)
    d = read_generation_defaults(str(other), None, '{"min_p": 0.1, "max_new_tokens": 8}', EOS)
    assert d.sampling == {"repetition_penalty": 1.1, "min_p": 0.1, "max_tokens": 8}
    assert read_generation_defaults("auto", None, None, EOS) == GenerationDefaults()


@pytest.mark.parametrize("args, match", [
    (dict(generation_config="nowhere"), "generation_config must be 'auto', 'vllm' or a folder"),
    (dict(override_generation_config={"max_tokens": 5}),
     "unknown key.*max_tokens.*max_new_tokens"),
    (dict(override_generation_config="[1]"), "override_generation_config must be a dict"),
])
def test_bad_settings_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**args)


def test_a_bad_value_in_the_file_names_the_file(tmp_path):
    folder = _folder(tmp_path, temperature=-1)
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        read_generation_defaults("auto", folder, None, EOS)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        read_generation_defaults("auto", folder, None, EOS)


def test_extra_eos_ids_join_the_stop_tokens_unless_ignore_eos():
    ids = frozenset({7, 9})
    sp = SamplingParams(stop_token_ids=[9, 4])
    assert with_generation_eos(sp, ids).stop_token_ids == [9, 4, 7]
    assert sp.stop_token_ids == [9, 4]  # the caller's params are left alone
    ignoring = SamplingParams(ignore_eos=True)
    assert with_generation_eos(ignoring, ids) is ignoring
    assert GenerationDefaults(eos_token_ids=ids).within(8).eos_token_ids == {7}


@pytest.fixture(scope="module")
def folder_with_defaults(tiny_llama_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gen-defaults")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def test_generate_without_params_uses_the_generation_config(folder_with_defaults):
    _folder(folder_with_defaults, temperature=0.0, max_new_tokens=5)
    llm = tiny_llm(folder_with_defaults)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompt = random_prompts(1, seed=21, lo=12, hi=13)[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5 and out.token_ids == greedy[:len(out.token_ids)]
    plain = tiny_llm(folder_with_defaults, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_the_file_s_extra_eos_id_stops_generation_as_a_stop_token(folder_with_defaults):
    prompt = random_prompts(1, seed=22, lo=12, hi=13)[0]
    _folder(folder_with_defaults)
    free = tiny_llm(folder_with_defaults).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    stop = free[4]
    _folder(folder_with_defaults, eos_token_id=[2, stop])
    llm = tiny_llm(folder_with_defaults)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)[0].outputs[0]
    first = free.index(stop)
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == free  # ignore_eos ignores the file's EOS ids too


def test_max_new_tokens_caps_max_tokens_set_or_not():
    from shoal.engine.generation_defaults import capped_max_tokens

    assert capped_max_tokens(None, {}) is None and capped_max_tokens(40, {}) == 40
    assert capped_max_tokens(None, {"max_tokens": 8}) == 8
    assert capped_max_tokens(40, {"max_tokens": 8}) == 8
    assert capped_max_tokens(3, {"max_tokens": 8}) == 3
