"""Errors as typed codes: every ErrorCode has one exception (the offline LLM and the server's
RequestStream raise it) and one HTTP status with an OpenAI error body; the code travels last
on EngineCoreOutput."""

from __future__ import annotations

import msgspec
import pytest

from shoal.core.errors import ErrorCode
from shoal.core.types import EngineCoreOutput
from shoal.engine.request_errors import (
    BadRequestError,
    EngineDeadError,
    EngineRequestError,
    ReplicaLostError,
    RequestError,
    RequestTimeoutError,
    request_error,
)
from shoal.entrypoints.openai.errors import (
    HTTP_STATUS,
    error_body,
    error_from_exception,
)

# code -> (exception class, the builtin a Python caller catches, status, body type)
EXPECTED = {
    ErrorCode.BAD_REQUEST: (BadRequestError, ValueError, 400, "BadRequestError"),
    ErrorCode.TIMED_OUT: (RequestTimeoutError, TimeoutError, 504, "GatewayTimeoutError"),
    ErrorCode.NON_FINITE: (EngineRequestError, RuntimeError, 500, "InternalServerError"),
    ErrorCode.OUTSIDE_GRAMMAR: (EngineRequestError, RuntimeError, 500, "InternalServerError"),
    ErrorCode.ENGINE_FAILED: (EngineRequestError, RuntimeError, 500, "InternalServerError"),
    ErrorCode.REPLICA_LOST: (ReplicaLostError, EngineDeadError, 503, "ServiceUnavailableError"),
}


def test_every_code_has_an_exception_and_a_status():
    assert set(EXPECTED) == set(ErrorCode) == set(HTTP_STATUS)
    assert all(code > 0 for code in ErrorCode)  # none is falsy


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_code_to_exception_to_status(code):
    cls, builtin, status, kind = EXPECTED[code]
    exc = request_error(code, "what went wrong")
    assert type(exc) is cls and isinstance(exc, builtin) and isinstance(exc, RequestError)
    assert exc.code == code and str(exc) == "what went wrong"
    err = error_from_exception(exc)
    assert err.status == status
    body = error_body(err.status, err.message, err.param)["error"]
    assert (body["code"], body["type"]) == (status, kind)
    assert "what went wrong" in body["message"]


def test_an_error_without_a_code_is_an_engine_failure_never_a_bad_request():
    exc = request_error(None, "structured_outputs.regex is invalid")
    assert type(exc) is EngineRequestError and exc.code == ErrorCode.ENGINE_FAILED
    assert error_from_exception(exc).status == 500


def test_a_bad_request_names_its_field_and_the_message_text_decides_nothing():
    err = error_from_exception(request_error(ErrorCode.BAD_REQUEST,
                                             "structured_outputs.regex is invalid: (?=a)"))
    assert (err.status, err.param) == (400, "structured_outputs")
    # The text of another kind does not make a 400 (the old "bad request: " prefix).
    assert error_from_exception(request_error(ErrorCode.NON_FINITE,
                                              "bad request: no")).status == 500


def test_the_code_is_last_on_the_wire_and_one_nil_without_an_error():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutput)
    plain = msgspec.msgpack.decode(enc.encode(EngineCoreOutput("r", [1, 2])))
    assert plain[-1] is None and len(plain) == len(EngineCoreOutput.__struct_fields__)
    failed = EngineCoreOutput("r", [], finish_reason="error", error="late",
                              error_code=ErrorCode.TIMED_OUT)
    back = dec.decode(enc.encode(failed))
    assert back == failed and type(back.error_code) is ErrorCode
    assert msgspec.msgpack.decode(enc.encode(failed))[-1] == int(ErrorCode.TIMED_OUT)
