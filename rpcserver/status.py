"""Map the cores' errors to gRPC status codes, in one place for every servicer."""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc

from rpcserver.errors import (FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, ServiceError,
                              Unavailable)
from rpcserver.handlers import MalformedRequest

log = logging.getLogger(__name__)

STATUS_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_from_number(number: int) -> grpc.StatusCode:
    """The status a wire number stands for (an `error_code` field of a multiplexed call); UNKNOWN if none."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class SharedCallError(grpc.aio.AioRpcError):
    """One request's end on a call shared by many, raised as a call of its own would have failed.

    Callers handle it as any downstream AioRpcError: its status is passed on, UNAVAILABLE retried.
    """

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def status_for(error: ServiceError) -> grpc.StatusCode:
    for kind, code in STATUS_CODES.items():
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def code_for(error: BaseException | None, context: grpc.aio.ServicerContext, handled: bool = True
             ) -> grpc.StatusCode:
    """The status a call that ended with `error` (None: returned normally) sends, for logs and metrics.

    handled: the error is still on its way through grpc_errors, which turns it into a status (as
    inside a servicer method). False: it has escaped the method, outside grpc_errors (as seen by an
    interceptor), and grpc.aio answers any exception but an abort with UNKNOWN.
    """
    if error is None or isinstance(error, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if not handled:
        return grpc.StatusCode.UNKNOWN
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    if isinstance(error, ServiceError):
        return status_for(error)
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
    if isinstance(error, grpc.aio.AioRpcError):
        # A downstream call failed: pass its status on (UNAVAILABLE, RESOURCE_EXHAUSTED, ...).
        await context.abort(error.code(), error.details() or "")
    if isinstance(error, ServiceError):
        await context.abort(status_for(error), str(error))
    log.exception("internal error", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


async def _reject_malformed(context: grpc.aio.ServicerContext, request: MalformedRequest) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid {request.type_name} message ({request.error}); "
                        "string fields must be valid UTF-8")


def grpc_errors(method):
    """Decorate a servicer method (unary or server-streaming) so core errors become status codes."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            if isinstance(request, MalformedRequest):
                await _reject_malformed(context, request)
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise  # already a status
            except Exception as e:  # noqa: BLE001 - every other error must reach the client as a status
                await _abort(context, e)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        if isinstance(request, MalformedRequest):
            await _reject_malformed(context, request)
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
    return unary
