"""The server's own settings (everything `shoal serve` takes besides engine arguments).

Like EngineArgs, each field carries its flag's help text: shoal.entrypoints.cli_args turns
the fields into `shoal serve` flags, so a new setting is one field here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A field with its flag's help text; `flag` holds extra argparse options (nargs,
    choices)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class ServerSettings:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    api_key: str | None = setting(None, "require 'Authorization: Bearer <key>' on every route "
                                        "but /health")
    served_model_name: list[str] | None = setting(
        None, "the model name(s) clients use (the first one is reported; default: the model "
              "argument)", nargs="+")
    shutdown_timeout: float = setting(30.0, "seconds to let in-flight requests finish after "
                                            "SIGTERM")
    uvicorn_log_level: str = setting("info", "uvicorn's log level", choices=[
        "critical", "error", "warning", "info", "debug", "trace"])
    disable_uvicorn_access_log: bool = setting(False, "no access log line per request")
