"""What `shoal bench throughput` and `latency` share: engine flags, presets, the LLM, records."""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import datetime
from typing import Any

from shoal.benchmarks.presets import Preset, apply_engine_preset
from shoal.benchmarks.serve import command_line
from shoal.entrypoints.cli_args import add_engine_flags, engine_args_from


def add_common_flags(p: argparse.ArgumentParser, presets: dict[str, Preset]) -> None:
    p.add_argument("--model", default=None,
                   help="model name, .gguf file or folder (default: embedded SmolLM2-135M)")
    p.add_argument("--preset", default=None, choices=sorted(presets),
                   help="a BENCHMARKS.md workload (sets requests, sampling, engine)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default 1.0 (as vLLM), or the preset's")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--output-json", default=None, help="write the result here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_flags(p)


def engine_defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return {"model": None, **vars(p.parse_args([]))}


def apply_preset(ns: argparse.Namespace, presets: dict[str, Preset]) -> Preset | None:
    if not ns.preset:
        if ns.temperature is None:
            ns.temperature = 1.0
        return None
    preset = presets[ns.preset]
    apply_engine_preset(ns, preset, engine_defaults())
    if ns.temperature is None:
        ns.temperature = preset.temperature
    return preset


def make_llm(ns: argparse.Namespace) -> Any:
    from shoal.llm import LLM

    args = engine_args_from(ns)
    return LLM(**dict(vars(args).items()))


def record(ns: argparse.Namespace, kind: str, figures: dict[str, Any]) -> dict[str, Any]:
    import torch

    import shoal

    engine = {k: v for k, v in vars(engine_args_from(ns)).items()}
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "benchmark": kind,
            "preset": ns.preset, "command": command_line(kind),
            "host": platform.node(), "shoal": shoal.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "engine_args": engine, **figures}


def save(path: str | None, result: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")
    print(f"result: {path}")
