"""The exceptions a frontend raises for a request the engine ended with an error: one per
ErrorCode, chosen here and nowhere else (the server's RequestStream, the offline LLM). Each
also is the builtin exception a Python caller expects (ValueError for a bad request,
TimeoutError past request_timeout), and each carries its code, which is all the HTTP server
reads to pick a status (shoal/entrypoints/openai/errors.py)."""

from __future__ import annotations

from typing import Any

from shoal.core.errors import ErrorCode


class RequestError(Exception):
    """The engine ended the request with an error; `code` says why. The offline LLM raises
    it once the whole batch has ended and sets `outputs` to every request's output (the
    failed ones with their error), so nothing the batch computed is lost."""

    def __init__(self, message: str, code: ErrorCode):
        super().__init__(message)
        self.code = code
        self.outputs: list[Any] | None = None


class BadRequestError(RequestError, ValueError):
    """The request was wrong (e.g. a grammar the backend cannot compile): HTTP 400."""


class RequestTimeoutError(RequestError, TimeoutError):
    """The request took longer than request_timeout: HTTP 504. A TimeoutError, not a
    ValueError: the same request may well finish on a less busy engine."""


class EngineRequestError(RequestError, RuntimeError):
    """The engine failed this request (non-finite logits, a step that raised, a token outside
    the grammar): HTTP 500."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing in flight will finish."""


class ReplicaLostError(RequestError, EngineDeadError):
    """The data-parallel replica running the request died (the others keep serving)."""


_EXCEPTIONS: dict[ErrorCode, type[RequestError]] = {
    ErrorCode.BAD_REQUEST: BadRequestError,
    ErrorCode.TIMED_OUT: RequestTimeoutError,
    ErrorCode.NON_FINITE: EngineRequestError,
    ErrorCode.OUTSIDE_GRAMMAR: EngineRequestError,
    ErrorCode.ENGINE_FAILED: EngineRequestError,
    ErrorCode.REPLICA_LOST: ReplicaLostError,
}


def request_error(code: ErrorCode | int | None, message: str) -> RequestError:
    """The exception for a request that ended with `message`. An error without a code (from
    a producer that predates the codes) is an engine failure: a 500, never a 400."""
    code = ErrorCode.ENGINE_FAILED if code is None else ErrorCode(code)
    return _EXCEPTIONS[code](message, code)


def first_request_error(outputs: list[Any]) -> RequestError | None:
    """The exception of the first output (a RequestOutput) the engine ended with an error."""
    failed = next((o for o in outputs if o.error), None)
    return None if failed is None else request_error(failed.error_code, failed.error)
