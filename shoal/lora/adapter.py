"""A PEFT LoRA folder, read and checked without torch: adapter_config.json and the tensor
names and shapes of adapter_model.safetensors (its JSON header). The frontend checks an
adapter before any request uses it, and the engine core checks again, against the
projections the model can take an adapter on (LoRALimits, from the worker); the worker then
reads the tensors themselves (shoal/lora/weights.py). Adapters of MoE experts are named and
checked by shoal/lora/expert_adapter.py. Reading a folder also takes the digest of its files
(adapter_digest.py): what the prefix cache keys the adapter's KV blocks by."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shoal.config.lora import ALL_LINEAR, EXPERTS, TARGET_MODULES_SETTING
from shoal.lora.adapter_digest import digest_and_header, file_stamp
from shoal.lora.expert_adapter import check_experts, expert_target, stacked_name
from shoal.lora_request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# Module names PEFT adapters use for layers shoal cannot take an adapter on, with the reason.
_REFUSED = {"lm_head": "the LM head", "embed_tokens": "the token embedding",
            "gate": "the MoE router", "shared_expert_gate": "the shared expert's gate"}


class LoRALimits(msgspec.Struct, frozen=True):
    """What an adapter is checked against (EngineLimits.lora)."""

    max_loras: int
    max_lora_rank: int
    # checkpoint module name (model.layers.0.self_attn.q_proj) -> (in_features, out_features)
    targets: dict[str, tuple[int, int]]
    # MoE experts module name (model.layers.0.mlp.experts) -> (num_experts, hidden,
    # moe_intermediate_size): the routed experts that take LoRA (expert_adapter.py)
    experts: dict[str, tuple[int, int, int]] = msgspec.field(default_factory=dict)
    # the leaf names of the model's adaptable modules that lora_target_modules leaves
    # without slots ("experts": the routed experts): their adapters are refused by name
    left_out: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModuleAdapter:
    """One projection's A [rank, in] and B [out, rank], and the scale of B A."""

    name: str  # the base checkpoint's module name
    rank: int
    in_features: int
    out_features: int
    scaling: float
    a_key: str  # tensor names in the safetensors file
    b_key: str
    # > 0: a stacked MoE expert parameter, A [experts * rank, in], B [out, experts * rank]
    # (expert_adapter.py); 0: one projection
    experts: int = 0


@dataclass(frozen=True)
class AdapterSpec:
    path: str
    rank: int  # the config's r (modules may differ through rank_pattern)
    modules: dict[str, ModuleAdapter]
    digest: str  # of the files this spec was read from (adapter_digest.py)


def read_adapter(path: str) -> AdapterSpec:
    """The folder's config and tensor layout; ValueError naming what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {path!r} does not exist")
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ValueError(f"LoRA adapter {path!r} has adapter_model.bin only: shoal reads "
                             f"{WEIGHTS_FILE} (save it with safe_serialization=True)")
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    stamp = (file_stamp(config_file), file_stamp(weights_file))
    return _read_cached(str(folder.resolve()), stamp)


def with_content_digest(lora: LoRARequest) -> LoRARequest:
    """The request's adapter with the digest of its files as they are now (the engine core's
    call when a request or add_lora arrives): what its KV blocks are keyed by and what the
    worker ranks check the files they read against. ValueError when the folder is not an
    adapter (any digest a caller set is replaced)."""
    digest = read_adapter(lora.lora_path).digest
    return lora if lora.content_digest == digest else msgspec.structs.replace(
        lora, content_digest=digest)


Stamp = tuple[tuple[int, ...], tuple[int, ...]]
_CACHE: dict[tuple[str, Stamp], AdapterSpec] = {}


def _read_cached(path: str, stamp: Stamp) -> AdapterSpec:
    key = (path, stamp)
    spec = _CACHE.get(key)
    if spec is None:
        if len(_CACHE) >= 256:
            _CACHE.clear()
        spec = _CACHE[key] = _read(Path(path))
    return spec


def _read(folder: Path) -> AdapterSpec:
    try:
        raw = (folder / CONFIG_FILE).read_bytes()
        config = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(folder)!r}: {CONFIG_FILE} is not valid JSON "
                         f"({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(folder)!r}: {CONFIG_FILE} is not a JSON object")
    _check_config(config, folder)
    weights = folder / WEIGHTS_FILE
    try:
        digest, header = digest_and_header(raw, weights)
    except OSError as e:
        raise ValueError(f"LoRA adapter weights {str(weights)!r} cannot be read ({e})") from None
    shapes = _header_shapes(header, weights)
    return AdapterSpec(str(folder), int(config["r"]), _modules(config, shapes, folder), digest)


def _check_config(config: dict[str, Any], folder: Path) -> None:
    where = f"LoRA adapter {str(folder)!r}"
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where} is a {peft_type} adapter; only LORA is supported")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer (got {r!r})")
    if config.get("use_dora"):
        raise ValueError(f"{where} uses DoRA (use_dora), which is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"{where} trains biases (bias={config.get('bias')!r}); only "
                         "bias='none' is supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{where} has fan_in_fan_out=true (Conv1D layers), which is not "
                         "supported")
    if config.get("modules_to_save"):
        raise ValueError(f"{where} saves whole modules (modules_to_save="
                         f"{config['modules_to_save']!r}), which is not supported")


def _header_shapes(header: bytes, file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors file's JSON header."""
    try:
        tensors = json.loads(header)
        if not isinstance(tensors, dict):
            raise ValueError("its header is not a JSON object")
        tensors.pop("__metadata__", None)
        return {name: list(meta["shape"]) for name, meta in tensors.items()}
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"LoRA adapter weights {str(file)!r} are not a safetensors file "
                         f"({e})") from None


def _modules(config: dict[str, Any], shapes: dict[str, list[int]],
             folder: Path) -> dict[str, ModuleAdapter]:
    where = f"LoRA adapter {str(folder)!r}"
    pairs: dict[str, dict[str, str]] = {}
    for key in shapes:
        name = key.removeprefix(_PEFT_PREFIX)
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        refused = [what for leaf, what in _REFUSED.items() if f".{leaf}." in f".{name}"]
        if m is None and refused:
            raise ValueError(f"{where} adapts {refused[0]} ({key}); LoRA on it is not "
                             "supported")
        if m is None:
            what = ("DoRA magnitudes" if "lora_magnitude" in key else
                    "embedding adapters" if "lora_embedding" in key else "a tensor")
            raise ValueError(f"{where} has {what} shoal cannot use: {key!r}")
        module = stacked_name(m.group(1), config) if config.get("target_parameters") \
            else m.group(1)
        pairs.setdefault(module, {})[m.group(2)] = key
    if not pairs:
        raise ValueError(f"{where} has no LoRA tensors")
    modules = {}
    for name, keys in pairs.items():
        if set(keys) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(keys)).pop()
            raise ValueError(f"{where}: module {name!r} has no {missing} tensor")
        a, b = shapes[keys["lora_A"]], shapes[keys["lora_B"]]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise ValueError(f"{where}: module {name!r} has A {a} and B {b}, not [r, in] and "
                             "[out, r]")
        rank, experts = a[0], 0
        target = expert_target(name)
        if target is not None and target.expert is None:  # PEFT's stacked experts
            rank = int(_pattern_value(config.get("rank_pattern"), name, config["r"]))
            if a[0] % rank:
                raise ValueError(f"{where}: module {name!r} has A {a}, not [experts * r, in] "
                                 f"for its r = {rank}")
            experts = a[0] // rank
        alpha = float(_pattern_value(config.get("alpha_pattern"), name,
                                     config.get("lora_alpha", 8)))
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[name] = ModuleAdapter(name, rank, a[1], b[0], scaling,
                                      keys["lora_A"], keys["lora_B"], experts)
    return modules


def _pattern_value(patterns: Any, name: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the
    module's name (at a dot)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?(?:{pattern})$", name):
            return value
    return default


def check_adapter(path: str, limits: LoRALimits | None) -> AdapterSpec:
    """The adapter at `path`, checked against what the engine can serve."""
    if limits is None:
        raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
    spec = read_adapter(path)
    where = f"LoRA adapter {path!r}"
    name = next((n for n in spec.modules if expert_target(n) is not None), None)
    if name is not None and EXPERTS in limits.left_out:
        raise ValueError(_left_out_message(where, name, EXPERTS))
    check_experts(where, spec.modules, limits.experts, limits.max_lora_rank)
    for name, mod in spec.modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _REFUSED:
            raise ValueError(f"{where} adapts {_REFUSED[leaf]} ({name}); LoRA on it is not "
                             "supported")
        if expert_target(name) is not None:
            continue  # checked above
        shape = limits.targets.get(name)
        if shape is None and leaf in limits.left_out:
            raise ValueError(_left_out_message(where, name, leaf))
        if shape is None:
            if ".experts." in name or name.endswith(".experts"):
                raise ValueError(f"{where} adapts MoE experts ({name}) in a layout shoal does "
                                 "not read (PEFT's target_parameters over the stacked "
                                 "gate_up_proj / down_proj, or per-expert gate/up/down_proj)")
            raise ValueError(f"{where} adapts {name!r}, which this model has no LoRA-capable "
                             "projection of")
        if mod.rank > limits.max_lora_rank:
            raise ValueError(f"{where} has rank {mod.rank} on {name}, more than "
                             f"max_lora_rank ({limits.max_lora_rank})")
        if (mod.in_features, mod.out_features) != tuple(shape):
            raise ValueError(f"{where}: {name} is {mod.in_features} -> {mod.out_features} "
                             f"in the adapter but {shape[0]} -> {shape[1]} in the model (an "
                             "adapter of another base model?)")
    return spec


def _left_out_message(where: str, module: str, leaf: str) -> str:
    setting = TARGET_MODULES_SETTING
    if leaf == EXPERTS:
        return (f"{where} adapts MoE experts ({module}), but this engine holds no adapter "
                f"slots for them: start it with {setting} unset or listing '{EXPERTS}' "
                f"(e.g. --lora-target-modules {ALL_LINEAR} {EXPERTS})")
    return (f"{where} adapts {module}, but {setting} leaves '{leaf}' out: start the engine "
            f"with {leaf} listed (or {setting} unset) to serve it")
