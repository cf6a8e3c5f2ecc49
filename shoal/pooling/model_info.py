"""A pooling model's defaults, read as sentence-transformers would read them.

modules.json lists the pipeline (Transformer, Pooling, Normalize...); 1_Pooling/config.json
names the pooling mode; a Normalize module means unit-length embeddings. Without those files
the architecture decides: CLS for encoders, LAST for decoders, normalized (vLLM's default).
`pooler_config` (vLLM's --pooler-config, JSON) overrides pooling_type and normalize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.json_arg import json_object_of
from shoal.pooling_params import PoolingInfo

if TYPE_CHECKING:
    from shoal.models.interface import PoolingModel

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")
_ST_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_lasttoken", "LAST"))
_OVERRIDES = ("pooling_type", "normalize")


def parse_pooler_config(value: str | dict | None) -> dict[str, Any]:
    """--pooler-config: a JSON object (or a dict from Python) with pooling_type, normalize."""
    value = json_object_of(value, "pooler_config", _OVERRIDES)
    pt = value.get("pooling_type")
    if pt is not None and (not isinstance(pt, str) or pt.upper() not in POOLING_TYPES):
        raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)} "
                         f"(got {pt!r})")
    if "normalize" in value and not isinstance(value["normalize"], bool):
        raise ValueError("pooler_config.normalize must be a bool")
    return {**value, **({"pooling_type": pt.upper()} if pt else {})}


def read_sentence_transformers(folder: Path | None) -> dict[str, Any]:
    """pooling_type, normalize and max_seq_length where the folder's files say them."""
    if folder is None or not (folder / "modules.json").is_file():
        return {}
    out: dict[str, Any] = {}
    modules = json.loads((folder / "modules.json").read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    out["normalize"] = "Normalize" in kinds
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            cfg_path = folder / m.get("path", "") / "config.json"
            if cfg_path.is_file():
                cfg = json.loads(cfg_path.read_text())
                modes = [t for key, t in _ST_MODES if cfg.get(key)]
                if len(modes) > 1 or any(cfg.get(k) for k in ("pooling_mode_max_tokens",
                                                                "pooling_mode_mean_sqrt_len_tokens")):
                    raise ValueError(f"{cfg_path}: only one of CLS, MEAN or last-token pooling "
                                     "is supported")
                if modes:
                    out["pooling_type"] = modes[0]
    st = folder / "sentence_bert_config.json"
    if st.is_file():
        max_len = json.loads(st.read_text()).get("max_seq_length")
        if isinstance(max_len, int) and max_len > 0:
            out["max_seq_length"] = max_len
    return out


def build_pooling_info(model: PoolingModel, hf_config: Any, folder: Path | None,
                       overrides: dict[str, Any]) -> PoolingInfo:
    """What the loaded `model` offers, from its declarations (shoal/models/interface.py)."""
    st = read_sentence_transformers(folder)
    pooling_type = overrides.get("pooling_type") or st.get("pooling_type") or \
        model.default_pooling_type
    normalize = overrides.get("normalize", st.get("normalize", True))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    num_labels = int(model.num_labels)
    tasks = tuple(model.pooling_tasks)
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return PoolingInfo(
        tasks=tasks, hidden_size=int(model.hidden_size), pooling_type=pooling_type,
        normalize=bool(normalize), num_labels=num_labels,
        id2label=id2label if num_labels else {},
        matryoshka_dimensions=tuple(dims) if dims else None,
        is_matryoshka=bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
        is_cross_encoder="classify" in tasks and num_labels == 1)
