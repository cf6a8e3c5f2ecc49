"""The Markdown table of decoder architectures and the path each takes in shoal: shoal's own
class (shoal/models/registry.py) or the Transformers backend (transformers' modeling code with
shoal's paged attention), or refused at start-up with the reason.

    .venv/bin/python benchmarks/architectures_table.py

Generated, never written by hand: the rows are shoal's registered architectures and the
tiny configurations tests/models/test_transformers_backend.py runs (tests/transformers_archs.py);
each row's path is what the registry resolves under model_impl="auto", and the backend column
what building the backend's model for that configuration does (its start-up checks, on the
CPU, no weights). The test column is what that test asserts for the row."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import torch  # noqa: E402
from oracle import TINY_COMMON  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)
from transformers_archs import ARCHS, Arch  # noqa: E402

from shoal.models.registry import (  # noqa: E402
    model_path,
    resolve_model_class,
    supported_architectures,
)

NATIVE_TESTED = "tokens = transformers' and = shoal's class"
BACKEND_TESTED = "tokens = transformers' (chunked batches, prefix-cache hits)"


def _config(arch: Arch):
    cfg = AutoConfig.for_model(arch.model_type, **{**TINY_COMMON, **arch.fields})
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch.model_type]]
    return cfg


def _auto_path(cfg) -> str:
    try:
        cls = resolve_model_class(cfg)
    except ValueError:
        return "refused"
    return "shoal's class" if model_path(cls) == model_path(object) else "Transformers backend"


def _backend(cfg) -> str:
    """What model_impl="transformers" does at start-up: runs, or the refusal's reason."""
    try:
        cls = resolve_model_class(cfg, model_impl="transformers")
        with torch.device("cpu"):
            cls(cfg, torch.float32)
    except ValueError as e:
        return "refused: " + str(e).split(": ", 1)[-1]
    return "runs"


def _tested(arch: Arch, native: bool) -> str:
    if arch.refused is not None:
        return "refused at start-up"
    if arch.xfail is not None:
        return f"xfail: {arch.xfail}"
    if native and arch.native_xfail:
        return f"{BACKEND_TESTED}; shoal's class xfail: {arch.native_xfail}"
    return NATIVE_TESTED if native else BACKEND_TESTED


def rows() -> list[list[str]]:
    out: list[list[str]] = []
    tested_classes = set()
    for arch in ARCHS:
        cfg = _config(arch)
        name = cfg.architectures[0]
        tested_classes.add(name)
        path = _auto_path(cfg)
        config = arch.name if arch.name == arch.model_type else f"{arch.model_type} ({arch.name})"
        out.append([config, name, path, _backend(cfg), _tested(arch, path == "shoal's class")])
    for name in supported_architectures():
        if name not in tested_classes:
            out.append(["-", name, "shoal's class", "not tested", "shoal's own tests"])
    return out


def main() -> None:
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    table = rows()
    print("| config | transformers class | path (model_impl=auto) | model_impl=transformers "
          "| tested |")
    print("|---|---|---|---|---|")
    for r in table:
        print("| " + " | ".join(r) + " |")
    runs = sum(r[3] == "runs" for r in table)
    refused = sum(r[3].startswith("refused") for r in table)
    print(f"\n{len(table)} rows: the backend runs {runs} tested configurations and refuses "
          f"{refused}.")


if __name__ == "__main__":
    main()
