"""Map the cores' errors to gRPC status codes, in one place for every servicer."""
from __future__ import annotations

import functools
import inspect
import logging

import grpc

from rpcserver.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable

log = logging.getLogger(__name__)

STATUS_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(error: ServiceError) -> grpc.StatusCode:
    for kind, code in STATUS_CODES.items():
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
    if isinstance(error, grpc.aio.AioRpcError):
        # A downstream call failed: pass its status on (UNAVAILABLE, RESOURCE_EXHAUSTED, ...).
        await context.abort(error.code(), error.details() or "")
    if isinstance(error, ServiceError):
        await context.abort(status_for(error), str(error))
    log.exception("internal error", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def grpc_errors(method):
    """Decorate a servicer method (unary or server-streaming) so core errors become status codes."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
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
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
    return unary
