"""Command-line flags with vLLM's names, turned into EngineArgs and ServerSettings."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any

from shoal.engine.engine_args import EngineArgs

# EngineArgs fields that are not engine flags (the model is positional on `shoal serve`).
_NOT_FLAGS = {"model"}
_SCALARS: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool}


def _flag_type(annotation: Any) -> Any:
    """int, float, str or bool from an annotation such as 'int | None' (fields are annotated
    as strings under `from __future__ import annotations`)."""
    names = [t.strip() for t in str(annotation).split("|") if t.strip() != "None"]
    if len(names) != 1 or names[0] not in _SCALARS:
        raise TypeError(f"no command-line type for an engine argument of type {annotation!r}")
    return _SCALARS[names[0]]


def engine_flag_fields() -> list[Field]:
    return [f for f in fields(EngineArgs) if f.name not in _NOT_FLAGS]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (`--max-num-seqs` for max_num_seqs); booleans get
    --x/--no-x. Names, defaults and help texts all come from EngineArgs."""
    for f in engine_flag_fields():
        flag = "--" + f.name.replace("_", "-")
        typ, help_text = _flag_type(f.type), f.metadata.get("help", "")
        if typ is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_text)
        else:
            shown = "" if f.default is None else f" (default: {f.default})"
            parser.add_argument(flag, dest=f.name, type=typ, default=f.default,
                                help=help_text + shown)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in engine_flag_fields()}
    return EngineArgs(model=getattr(ns, "model", None), **kwargs)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model name, .gguf file or folder (default: embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on every route but /health")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) clients use (the first one is reported)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGTERM")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_engine_flags(parser)


def server_settings_from(ns: argparse.Namespace) -> Any:
    from shoal.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, ServerSettings

    names = ns.served_model_name or [ns.model or DEFAULT_MODEL_NAME]
    return ServerSettings(host=ns.host, port=ns.port, api_key=ns.api_key,
                          served_model_names=names, shutdown_timeout=ns.shutdown_timeout,
                          log_level=ns.uvicorn_log_level,
                          access_log=not ns.disable_uvicorn_access_log)
