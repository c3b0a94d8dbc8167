"""Prometheus metrics every server shares: calls by method and status code, and the /metrics endpoint."""
from __future__ import annotations

import inspect
import logging
import time

import grpc
import prometheus_client
from prometheus_client import Counter, Histogram

from rpcserver.status import code_for

log = logging.getLogger(__name__)

# Names and labels follow go-grpc-prometheus, so existing gRPC dashboards work unchanged.
LABELS = ("grpc_service", "grpc_method", "grpc_type")
STARTED = Counter("grpc_server_started_total", "RPCs started on the server", LABELS)
HANDLED = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code",
                  (*LABELS, "grpc_code"))
HANDLING_SECONDS = Histogram("grpc_server_handling_seconds", "time from an RPC's start to its status", LABELS,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    return {(False, False): "unary", (False, True): "server_stream", (True, False): "client_stream",
            (True, True): "bidi_stream"}[(handler.request_streaming, handler.response_streaming)]


class _Call:
    def __init__(self, labels: tuple[str, str, str]):
        self.labels = labels
        self.start = time.perf_counter()
        STARTED.labels(*labels).inc()

    def done(self, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
        HANDLED.labels(*self.labels, code_for(error, context, handled=False).name).inc()
        HANDLING_SECONDS.labels(*self.labels).observe(time.perf_counter() - self.start)


def _wrap(behavior, labels: tuple[str, str, str]):
    """Wrap a handler's function (coroutine or async generator) so each call is counted once."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            call, error = _Call(labels), None
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                error = e
                raise
            finally:
                call.done(context, error)
        return stream

    if inspect.iscoroutinefunction(behavior):
        async def unary(request, context):
            call, error = _Call(labels), None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                call.done(context, error)
        return unary
    return behavior  # a synchronous handler: left uncounted rather than run on the event loop


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call by service, method and final status code (including calls other interceptors refuse)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        labels = (service, method, _rpc_type(handler))
        kwargs = dict(request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, labels), **kwargs)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, labels), **kwargs)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, labels), **kwargs)
        return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, labels), **kwargs)


def start_metrics_server(host: str, port: int) -> None:
    """Serve /metrics over HTTP on host:port in a daemon thread; port 0 means metrics are off."""
    if not port:
        return
    try:
        prometheus_client.start_http_server(port, addr=host)
    except OSError as e:
        raise SystemExit(f"cannot serve metrics on {host}:{port}: {e}") from None
    log.info("metrics on http://%s:%d/metrics", host, port)
