"""OpenAI error bodies and the exception -> status mapping: user input never yields a 500.

A request the engine ended with an error arrives as a RequestError carrying its ErrorCode;
its status comes from HTTP_STATUS, by code (the message text is never read)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.core.errors import ErrorCode
from shoal.engine.async_llm import QueueFullError
from shoal.engine.request_errors import EngineDeadError, RequestError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# The status of a request the engine ended with an error, by why.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.TIMED_OUT: 504,  # the server gave up waiting for its own engine
    ErrorCode.NON_FINITE: 500,
    ErrorCode.OUTSIDE_GRAMMAR: 500,
    ErrorCode.ENGINE_FAILED: 500,
    # As for an engine that died: the service failed, not the request (a retry goes to a
    # live replica).
    ErrorCode.REPLICA_LOST: 503,
}
# "temperature must be ...", "prompt is 3000 tokens ...": the field a ValueError names.
_PARAM_RE = re.compile(r"^([a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+)?(?: strings| token ids)? "
                       r"(?:must|is|token|values|needs|has \d+)\b")


class ServerShuttingDown(RuntimeError):
    """The --shutdown-timeout deadline passed with the request still running."""


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAI error for an exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):  # before ValueError and EngineDeadError: by its code
        return _from_request_error(exc)
    if isinstance(exc, QueueFullError):
        return OpenAIError(503, str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ServerShuttingDown):
        return OpenAIError(503, str(exc))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {exc}")
    if isinstance(exc, ValueError):
        message = str(exc) or "invalid request"
        # a ValueError may name its field itself (one whose message starts otherwise)
        return OpenAIError(400, message, getattr(exc, "param", None) or _param_of(message))
    logger.error("internal error", exc_info=exc)
    return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def renamed_param(exc: BaseException, rename: Callable[[str | None], str | None]
                  ) -> BaseException:
    """exc as an OpenAIError whose `param` is rename(its param), where that changes it: an
    endpoint's own name for a field the engine names otherwise (chat's top_logprobs for
    the engine's logprobs, messages for prompt)."""
    if not isinstance(exc, (ValueError, RequestError, OpenAIError)):
        return exc
    err = error_from_exception(exc)
    param = rename(err.param)
    if err.status != 400 or param == err.param:
        return exc
    return OpenAIError(err.status, err.message, param, err.headers)


@contextlib.contextmanager
def field_names(rename: Callable[[str | None], str | None]) -> Iterator[None]:
    """Errors raised inside name the request's fields as the request does (renamed_param)."""
    try:
        yield
    except Exception as e:
        new = renamed_param(e, rename)
        if new is e:
            raise
        raise new from e


def _from_request_error(exc: RequestError) -> OpenAIError:
    status = HTTP_STATUS[exc.code]
    message = str(exc)
    if status == 400:
        return OpenAIError(400, message, _param_of(message))
    if status == 500:
        message = f"the engine failed this request: {message}"
    return OpenAIError(status, message)


def _param_of(message: str) -> str | None:
    """The request field a ValueError of ours names, for the body's `param`."""
    m = _PARAM_RE.match(message)
    return m.group(1) if m else None


# pydantic names the union member that failed in the location ("temperature", "float").
_UNION_TAG = re.compile(r"^(float|int|str|bool|list|dict|none)$|[\[\]-]")


def _loc(error: Mapping[str, Any]) -> list[str]:
    return [str(x) for x in error.get("loc", ())
            if x != "body" and not (isinstance(x, str) and _UNION_TAG.search(x))]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = _loc(first)
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON in the request body: {detail}".rstrip(": "), None
    if first.get("type") in ("missing", "model_attributes_type") and not loc:
        return "the request body must be a JSON object", None
    param = loc[0] if loc else None
    path = ".".join(loc)
    text = f"{path}: {first.get('msg')}" if path else str(first.get("msg"))
    if first.get("type") not in (None, "missing"):
        text += f" [{first.get('type')}]"  # pydantic's error type, as vLLM's messages show it
    if first.get("type") != "missing":
        try:
            text += f" (got {json.dumps(first.get('input'))[:100]})"
        except (TypeError, ValueError):
            pass
    others = {".".join(_loc(e)) for e in errors[1:]} - {path}
    if others:
        text += f"; also invalid: {', '.join(sorted(others))}"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        err = error_from_exception(exc)
        return error_response(err.status, err.message, err.param, err.headers)

    # Expected errors go through Starlette's ExceptionMiddleware (no traceback in the log);
    # anything else reaches the Exception handler, which logs it as the bug it is.
    for cls in (OpenAIError, ValueError, QueueFullError, EngineDeadError, RequestError,
                ServerShuttingDown):
        app.add_exception_handler(cls, _known)
    app.add_exception_handler(Exception, _known)
