"""A model's generation_config.json, read as vLLM reads it.

--generation-config auto (the default) takes the sampling fields the model's creator wrote
there (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) as the defaults
of requests that leave them unset: `LLM.generate` without sampling params, and the server's
requests per field. `vllm` ignores them; a folder reads that folder's file instead of the
model's. --override-generation-config sets fields on top of either.

The file's eos_token_id list (Llama-3.1-Instruct's <|eot_id|> and <|eom_id|>, Qwen's
<|endoftext|>) ends generation under every setting: the ids beyond the model's own EOS are
added to each request's stop_token_ids unless it sets ignore_eos, as vLLM does (so its
stop_reason names the id)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from shoal.json_arg import json_object_of

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
SETTINGS = ("auto", "vllm")
# generation_config.json's sampling fields, and the SamplingParams names they set
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}


class GenerationDefaults(msgspec.Struct, frozen=True):
    """What requests inherit from the model's generation config (the engine's ready message
    carries it to every frontend)."""

    # SamplingParams field -> value, for requests that leave the field unset
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    # eos_token_id ids of the file beyond the model's own EOS: each request's stop tokens
    eos_token_ids: frozenset[int] = frozenset()

    def within(self, vocab_size: int) -> GenerationDefaults:
        """Without EOS ids the model cannot produce (a file of another vocabulary)."""
        outside = {i for i in self.eos_token_ids if i >= vocab_size}
        if not outside:
            return self
        logger.warning("generation config: eos_token_id %s past the vocabulary (%d) ignored",
                       sorted(outside), vocab_size)
        return GenerationDefaults(self.sampling, self.eos_token_ids - outside)


def check_generation_config_arg(value: Any) -> None:
    """generation_config: "auto", "vllm" or a folder holding a generation_config.json."""
    if not isinstance(value, str) or (value not in SETTINGS and not Path(value).is_dir()):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder that holds "
                         f"{FILE_NAME} (got {value!r})")


def parse_overrides(value: Any) -> dict[str, Any]:
    """override_generation_config as a dict of generation_config.json sampling fields."""
    return json_object_of(value, "override_generation_config", SAMPLING_FIELDS)


def read_generation_defaults(setting: str, model_folder: Path | None, overrides: Any,
                             model_eos_ids: frozenset[int]) -> GenerationDefaults:
    """The defaults for `setting` (check_generation_config_arg) of a model loaded from
    `model_folder` (None: a GGUF file or a model without a folder, which has no file).
    A sampling value SamplingParams refuses is a ValueError naming the file."""
    folder = model_folder if setting in SETTINGS else Path(setting)
    path = None if folder is None else folder / FILE_NAME
    config = _read(path) if path is not None and path.is_file() else {}
    fields = {} if setting == "vllm" else {k: config[k] for k in SAMPLING_FIELDS
                                           if config.get(k) is not None}
    fields.update(parse_overrides(overrides))
    sampling = {SAMPLING_FIELDS[k]: v for k, v in fields.items()}
    _check(sampling, path)
    eos = config.get("eos_token_id")
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if not all(isinstance(i, int) and i >= 0 for i in eos_ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them "
                         f"(got {eos!r})")
    defaults = GenerationDefaults(sampling, frozenset(eos_ids - model_eos_ids))
    if sampling:
        logger.info("request defaults from the generation config (%s): %s; "
                    "--generation-config vllm ignores them", path or "overrides", sampling)
    return defaults


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return config


def _check(sampling: dict[str, Any], path: Path | None) -> None:
    from shoal.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except (ValueError, TypeError) as e:
        where = path if path is not None else "override_generation_config"
        raise ValueError(f"generation config {where}: {e}") from None


def capped_max_tokens(max_tokens: int | None, defaults: Mapping[str, Any]) -> int | None:
    """A request's max_tokens under the generation config's max_new_tokens (its
    "max_tokens"), which caps an explicit one too, as vLLM's get_max_tokens does."""
    cap = defaults.get("max_tokens")
    if cap is None:
        return max_tokens
    return cap if max_tokens is None else min(max_tokens, cap)


def with_generation_eos(params: Any, eos_ids: frozenset[int]) -> Any:
    """SamplingParams with the generation config's extra EOS ids among its stop_token_ids
    (params itself under ignore_eos, or when there are none to add)."""
    if not eos_ids or params.ignore_eos:
        return params
    have = set(params.stop_token_ids or ())
    extra = sorted(eos_ids - have)
    if not extra:
        return params
    return dataclasses.replace(params, stop_token_ids=[*(params.stop_token_ids or ()), *extra])


def default_sampling_params(defaults: GenerationDefaults) -> Any:
    """vLLM's LLM.get_default_sampling_params: SamplingParams of the generation config's
    fields (vLLM's defaults where it has none)."""
    from shoal.sampling_params import SamplingParams

    return SamplingParams(**defaults.sampling)
