"""Command-line flags with vLLM's names, turned into EngineArgs and ServerSettings."""

from __future__ import annotations

import argparse
import json
from dataclasses import Field, fields
from typing import Any

from shoal.engine.engine_args import EngineArgs
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.sampling_params import SamplingParams

# EngineArgs fields that are not engine flags (the model is positional on `shoal serve`).
_NOT_FLAGS = {"model"}
_SCALARS: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool}


def _json_object(text: str) -> dict[str, Any]:
    """A dict-valued flag (--speculative-config '{"method": "ngram", ...}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _flag_type(annotation: Any) -> Any:
    """int, float, str or bool from an annotation such as 'int | None' or 'list[str] | None'
    (fields are annotated as strings under `from __future__ import annotations`; a list is
    a flag with nargs of its element type; a dict is one JSON object)."""
    names = [t.strip() for t in str(annotation).split("|") if t.strip() != "None"]
    if len(names) == 1 and names[0].startswith("dict["):
        return _json_object
    if len(names) == 1 and names[0].startswith("list[") and names[0].endswith("]"):
        names = [names[0][5:-1]]
    if len(names) != 1 or names[0] not in _SCALARS:
        raise TypeError(f"no command-line type for an engine argument of type {annotation!r}")
    return _SCALARS[names[0]]


def engine_flag_fields() -> list[Field]:
    return [f for f in fields(EngineArgs) if f.name not in _NOT_FLAGS]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (`--max-num-seqs` for max_num_seqs). Names, defaults and
    help texts all come from EngineArgs."""
    for f in engine_flag_fields():
        _add_flag(parser, f)


def _help(f: Field) -> str:
    return f.metadata.get("help", "")


def _add_flag(parser: argparse.ArgumentParser, f: Field) -> None:
    """`--field-name` (booleans get --x/--no-x); extra argparse options come from the
    field's metadata."""
    flag = "--" + f.name.replace("_", "-")
    typ = _flag_type(f.type)
    extra = {k: v for k, v in f.metadata.items() if k != "help"}
    if typ is bool:
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                            default=f.default,
                            help=_help(f), **extra)
        return
    shown = "" if f.default is None else f" (default: {f.default})"
    parser.add_argument(flag, dest=f.name, type=typ, default=f.default,
                        help=_help(f) + shown, **extra)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in engine_flag_fields()}
    return EngineArgs(model=getattr(ns, "model", None), **kwargs)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help=_help(next(f for f in fields(EngineArgs) if f.name == "model")))
    for f in fields(ServerSettings):
        _add_flag(parser, f)
    add_engine_flags(parser)


def server_settings_from(ns: argparse.Namespace) -> ServerSettings:
    return ServerSettings(**{f.name: getattr(ns, f.name) for f in fields(ServerSettings)})


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (--seed seeds the engine)")


def sampling_params_from(ns: argparse.Namespace, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=ns.max_tokens, temperature=ns.temperature,
                          top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                          repetition_penalty=ns.repetition_penalty, seed=ns.sampling_seed)


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    """The flags of `python -m shoal.entrypoints.openai.run_batch` and `shoal run-batch`."""
    p.add_argument("-i", "--input-file", required=True, help="the batch file ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, help="the results ('-': stdout)")
    p.add_argument("--model", default=None, help="model (default: the embedded one)")
    p.add_argument("--served-model-name", default=None, help="the name in the responses")
    p.add_argument("--enable-metrics", action="store_true",
                   help="serve the run's Prometheus metrics on --host:--port while it runs")
    p.add_argument("--host", default="127.0.0.1", help="the metrics server's address")
    p.add_argument("--port", type=int, default=8000, help="the metrics server's port")
    add_engine_flags(p)
