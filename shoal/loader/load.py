"""load_model: resolve a model argument, then read config, tokenizer and (lazy) weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.loader.gguf_loader import load_gguf
from shoal.loader.gguf_tokenizer import build_gguf_tokenizer
from shoal.loader.kv_scales import KVScales, without_kv_scales
from shoal.loader.loaded_model import LoadedModel, no_weights
from shoal.loader.resolve import ModelSource, resolve_model
from shoal.loader.safetensors_loader import folder_weights, load_folder_config
from shoal.loader.text_only import declares_vision, text_only
from shoal.loader.tokenizers import load_folder_tokenizer, load_tokenizer
from shoal.quantization.config import detect_quantization, model_unpacked, resolve_quantization
from shoal.quantization.weights import dequantized_weights

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


def load_model(
    model: str | None = None, *, tokenizer: str | None = None, load_format: str = "auto",
    quantization: str | None = None, language_model_only: bool = False,
) -> LoadedModel:
    """Load `model` (None = embedded SmolLM2-135M-Instruct, a known name, or a local path).

    `tokenizer` names another tokenizer source (known name, .gguf file or folder).
    load_format "dummy" resolves config and tokenizer but yields no weights.
    `quantization`: None takes the checkpoint's own (a quantized safetensors folder streams
    dequantized weights: shoal/quantization); see resolve_quantization for the rest.
    `language_model_only`: a multimodal checkpoint whose text model runs alone loads as that
    (loader/text_only.py).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    source = resolve_model(model)
    _check_format(source, load_format)
    dummy = load_format == "dummy"
    kv_scales = KVScales()
    qconfig = None
    if source.kind == "gguf":
        if quantization not in (None, "gguf"):
            raise ValueError(f"quantization={quantization!r} does not apply to the GGUF file "
                             f"{source.path}: its own types are dequantized (use None or 'gguf')")
        loaded = load_gguf(source.path, with_weights=not dummy)
        config, weights = loaded.config, loaded.weights
        tok = None if tokenizer is not None else build_gguf_tokenizer(loaded.file)
        used_format = "dummy" if dummy else "gguf"
    else:
        full_config = load_folder_config(source.path)
        # (dummy weights: quantized by it on the GPU, kept dense on the CPU)
        qconfig = resolve_quantization(
            quantization, detect_quantization(full_config, source.path), str(source.path))
        config, rename = _text_only(full_config, source.path, language_model_only)
        weights = (no_weights if dummy else
                   _streamed(source.path, config, rename, qconfig, kv_scales))
        tok = None if tokenizer is not None else load_folder_tokenizer(source.path)
        used_format = "dummy" if dummy else "safetensors"
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    return LoadedModel(
        hf_config=config,
        tokenizer=tok,
        source=str(source.path),
        weights=weights,
        load_format=used_format,
        kv_scales=kv_scales,
        quantization=qconfig,
    )


def checkpoint_weights(model: str, quantization: str | None = None,
                       language_model_only: bool = False) -> Any:
    """The weights of a checkpoint (folder or .gguf) as load_model streams them, without
    its tokenizer: a weight update's source."""
    source = resolve_model(model)
    if source.kind == "gguf":
        return load_gguf(source.path, with_weights=True).weights
    full_config = load_folder_config(source.path)
    qconfig = resolve_quantization(quantization, detect_quantization(full_config, source.path),
                                   str(source.path))
    config, rename = _text_only(full_config, source.path, language_model_only)
    return _streamed(source.path, config, rename, qconfig, KVScales())


def _text_only(config: Any, folder: Path, language_model_only: bool) -> tuple[Any, Any]:
    return text_only(config, language_model_only or not declares_vision(folder))


def _streamed(path: Path, config: Any, rename: Any, qconfig: Any, kv_scales: KVScales) -> Any:
    """A folder's weights in float32, or as stored and dequantized as they stream; a format
    the model unpacks itself (MXFP4) keeps its integer tensors as stored."""
    if qconfig is None:
        stream = folder_weights(path, config, rename, keep_integers=model_unpacked(config))
        return without_kv_scales(stream, kv_scales)
    stored = folder_weights(path, config, rename, dtype=None)
    return dequantized_weights(without_kv_scales(stored, kv_scales), qconfig)


def _check_format(source: ModelSource, load_format: str) -> None:
    path: Path = source.path
    if load_format == "gguf" and source.kind != "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, but {path} is a folder")
    if load_format == "safetensors" and source.kind != "folder":
        raise ValueError(
            f"load_format='safetensors' needs a folder with *.safetensors, but {path} is a GGUF file"
        )
