"""The command-line flags the benchmark scripts share, with one spelling and one help text.

    p = argparse.ArgumentParser(description=__doc__.split("\\n")[0])
    add_common(p, out=REQUIRED, model=LLAMA_8B, dtype="bfloat16", repeats=3,
               smoke="batch 1 and 4, 16 in / 24 out")

Each keyword adds its flag with that default (REQUIRED: the flag must be given); the
script's own flags stay in the script. Standard library only (the W6 worker parses its
flags in the vLLM virtualenv)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

REQUIRED: Any = object()

# name -> (flag, type, help)
FLAGS: dict[str, tuple[str, Any, str]] = {
    "out": ("--out", Path, "JSON file for the results"),
    "model": ("--model", str, "model name, .gguf file or folder"),
    "dtype": ("--dtype", str, "engine dtype"),
    "load_format": ("--load-format", str, "auto, or dummy (random weights of the shape)"),
    "seed": ("--seed", int, "seed of the requests' random draws"),
    "repeats": ("--repeats", int, "timed runs per figure (the median is reported)"),
    "rounds": ("--rounds", int, "interleaved rounds of the engines or variants compared"),
    "device": ("--device", str, "engine device (default: cuda where there is one)"),
    "threads": ("--threads", int, "torch threads (default: torch's own)"),
    "num_requests": ("--num-requests", int, "requests in the batch"),
    "max_num_seqs": ("--max-num-seqs", int, "the engine's max_num_seqs"),
}


def add_common(p: argparse.ArgumentParser, smoke: str | None = None, **defaults: Any) -> None:
    """Adds the named shared flags; `smoke` (its help text) adds --smoke."""
    for name, default in defaults.items():
        flag, kind, text = FLAGS[name]
        if default is REQUIRED:
            p.add_argument(flag, type=kind, required=True, help=text)
        else:
            p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    if smoke is not None:
        p.add_argument("--smoke", action="store_true", help=f"a quick check: {smoke}")


def comma_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def comma_floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def comma_words(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def int_range(text: str) -> tuple[int, int]:
    """"lo,hi" with 1 <= lo <= hi (a closed range of lengths)."""
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= lo <= hi, got {text!r}")
    return lo, hi
