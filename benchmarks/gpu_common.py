"""Shared bits of the GPU benchmark scripts: result records and hardware/commit lookup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    env = os.environ.get("SHOAL_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def record(workload: str, engine: str, **figures: Any) -> dict[str, Any]:
    import transformers

    return {
        "workload": workload,
        "hardware": hardware(),
        "commit": commit(),
        "engine": engine,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
        **figures,
    }


def write(records: list[dict[str, Any]], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
