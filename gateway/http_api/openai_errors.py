"""Failures as OpenAI error objects: the HTTP status and type a gRPC status maps to, and the field named."""
from __future__ import annotations

import asyncio
import logging
import re

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway.http_api.openai_protocol import FIELD_NAMES
from rpcserver.errors import ServiceError
from rpcserver.status import status_for

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    # A worker that cannot do what was asked (generating with an embedding-only checkpoint): vLLM answers 400 too.
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),  # as OpenAI answers an unknown model or URL
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}

# A message that starts with a field's path (`temperature must be`, `messages[0].content: ...`) names it.
_LEADING_PATH = re.compile(r'([A-Za-z_]\w*)(?:\[[^\]]*\]|\.[A-Za-z_]\w*)*')


class HttpError(Exception):
    """A failure of the HTTP front itself; `http_status`, `param`, `error_type` and `error_code` override what
    `code` gives."""

    def __init__(self, code: grpc.StatusCode, message: str, http_status: int | None = None,
                 param: str | None = None, error_code: str | int | None = None, headers: dict | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.code = code
        self.http_status = http_status
        self.param = param
        self.error_code = error_code
        self.headers = headers
        self.error_type = error_type


def grpc_code(error: BaseException | None) -> grpc.StatusCode:
    """The gRPC status a failure corresponds to, for logs, metrics and the HTTP status."""
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, HttpError):
        return error.code
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    if isinstance(error, ServiceError):
        return status_for(error)
    return grpc.StatusCode.INTERNAL


def param_of(message: str) -> str | None:
    """The request field a message starts with, as the message spells it; None if it names none."""
    match = _LEADING_PATH.match(message)
    return match.group(0) if match and match.group(1) in FIELD_NAMES else None


def error_body(error: BaseException) -> tuple[int, dict]:
    code = grpc_code(error)
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    param = getattr(error, "param", None)  # HttpError's, or a refused unknown field's
    if isinstance(error, HttpError):
        status = error.http_status or status
        kind = error.error_type or kind
    if isinstance(error, grpc.aio.AioRpcError):
        message = error.details() or code.name
    elif code == grpc.StatusCode.INTERNAL and not isinstance(error, ServiceError):
        log.exception("internal error", exc_info=error)
        message = f"internal error: {type(error).__name__}: {error}"
    else:
        message = str(error)
    if code == grpc.StatusCode.INVALID_ARGUMENT and param is None:
        param = param_of(message)
    error_code = getattr(error, "error_code", None) or code.name.lower()
    return status, {"error": {"message": message, "type": kind, "param": param, "code": error_code}}


def error_response(error: BaseException) -> JSONResponse:
    status, body = error_body(error)
    headers = dict(getattr(error, "headers", None) or {})
    if status == 413:
        # The rest of a body refused as too large is not worth reading: end the connection instead.
        headers["connection"] = "close"
    return JSONResponse(body, status_code=status, headers=headers or None)


def add_error_handlers(app: FastAPI) -> None:
    """Routes and methods the API lacks answer OpenAI error objects too, not the framework's `{"detail"}`."""

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            return error_response(HttpError(grpc.StatusCode.NOT_FOUND, f"no such route: {where}"))
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            return error_response(HttpError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{request.method} is not allowed on {request.url.path}; use "
                f"{allowed}", http_status=405, error_code="method_not_allowed", headers=exc.headers))
        return error_response(HttpError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc.detail}",
                                        http_status=exc.status_code, headers=exc.headers))
