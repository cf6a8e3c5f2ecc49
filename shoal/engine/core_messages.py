"""The messages between the frontend and the engine-core process (msgspec structs, msgpack on
the wire, never pickle):

    frontend -> engine   InputMessage: add / abort / utility / shutdown
    frontend <- engine   OutputMessage: ready / startup error / outputs / utility results

The loop that answers them is shoal/engine/core_proc.py; the frontend's side is
core_client.py (and dp_client.py for data-parallel replicas)."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.core.errors import ErrorCode
from shoal.core.types import EngineCoreOutputs, EngineCoreRequest
from shoal.engine.request_checks import EngineLimits


# ---- frontend -> engine --------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    method: str  # one of EngineCoreProc.UTILITIES
    args: list[Any] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


InputMessage = AddRequest | AbortRequests | UtilityCall | Shutdown


# ---- engine -> frontend --------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    """The core is serving: the limits the frontend validates requests against, exactly as
    the core will."""

    limits: EngineLimits
    pid: int


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class Rejection(msgspec.Struct, array_like=True):
    """Why the core refused a request (it never ran): a ValueError is the client's fault,
    anything else the engine's."""

    message: str
    code: ErrorCode = ErrorCode.BAD_REQUEST


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: EngineCoreOutputs
    # request id -> why the core refused it
    rejected: dict[str, Rejection] = msgspec.field(default_factory=dict)
    # request id -> why it was lost mid-flight (ErrorCode.REPLICA_LOST); only the
    # data-parallel client sets it, for the requests of a replica that died while the others
    # keep serving
    lost: dict[str, str] = msgspec.field(default_factory=dict)
    # the replica these came from (data parallelism; set by the frontend's client)
    engine_index: int = 0


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: Any = None
    error: str | None = None


OutputMessage = Ready | StartupFailed | CoreOutputs | UtilityResult
