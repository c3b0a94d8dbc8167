"""One grpc.aio server shape for every service: options, health, reflection, TLS and graceful stop."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rpcserver import collector
from rpcserver.config import ServerConfig
from rpcserver.loop_lag import LoopLagMonitor
from rpcserver.metrics import MetricsInterceptor, start_metrics_server
from rpcserver.shared import read_file

log = logging.getLogger(__name__)

# A health service name that answers SERVING for as long as the server's event loop answers calls,
# whatever the readiness ("" and the service names) says: for liveness probes, which must not restart
# a server that is only waiting for its model or its backends, or draining.
LIVENESS = "liveness"


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    max_message_bytes = config.max_message_bytes
    return [
        # Oversized requests are refused with RESOURCE_EXHAUSTED before they reach a handler.
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Ping idle connections so a client that vanished without closing is noticed and its
        # streams are cancelled, freeing what they hold.
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # The wait for a ping's ack is its own setting, a minute by default; without it a frozen
        # client (its process stopped, its sockets open) keeps its streams for that minute.
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Accept client pings as often as every second (gRPC's default minimum is 5 min), so
        # clients such as the gateway can watch their connections closely.
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC sets SO_REUSEPORT by default: a second server on a taken port binds beside the first
        # and the kernel splits connections between the two, with no error. Fail at start instead.
        ("grpc.so_reuseport", 0),
    ]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        if config.tls_client_ca or config.tls_key:
            raise SystemExit("--tls-client-ca and --tls-key need --tls-cert")
        return None
    if not config.tls_key:
        raise SystemExit("--tls-cert needs --tls-key")
    return grpc.ssl_server_credentials(
        [(read_file(config.tls_key), read_file(config.tls_cert))],
        root_certificates=read_file(config.tls_client_ca),
        require_client_auth=bool(config.tls_client_ca))


class GrpcServer:
    """A grpc.aio server with health and reflection; NOT_SERVING until `set_serving(True)`."""

    def __init__(self, config: ServerConfig, service_names: Iterable[str],
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = ()):
        self.config = config
        self.service_names = list(service_names)
        # Metrics outermost, so calls the others refuse (UNAUTHENTICATED) are counted too.
        metrics = [MetricsInterceptor()] if config.metrics_port else []
        self.server = grpc.aio.server(options=server_options(config),
                                      interceptors=[*metrics, *interceptors])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = 0
        self.draining = False
        self.serving = False
        # Every front of the process (gRPC, and the gateway's HTTP) shares this loop: one monitor covers them.
        self.loop_lag = LoopLagMonitor()

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        credentials = server_credentials(self.config)
        try:
            self.port = (self.server.add_secure_port(address, credentials) if credentials
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc's "Failed to bind", which names no cause; its log line does
            self.port = 0
        if not self.port:
            raise SystemExit(f"cannot listen on {address}: the address is already in use or not available here")
        await self.set_serving(False)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        start_metrics_server(self.config.host, self.config.metrics_port)
        await self.server.start()
        # Everything alive now (imports, mostly) lives as long as the process: a full collection would walk it
        # holding the GIL, and the worker's front paused 100 ms a collection while a long prompt's logprobs were read.
        collector.settle()
        log.info("listening on %s:%d (%s)", self.config.host, self.port, "TLS" if credentials else "plaintext")
        return self.port

    async def close(self) -> None:
        """Stop at once if still running: a start that fails after the port is bound (a checkpoint refused)
        must stop the server on its own loop, or grpc's __del__ does it after the loop is closed, with
        a traceback ("Event loop is closed") under the one-line reason. Harmless after a graceful stop."""
        await self.loop_lag.stop()
        await self.server.stop(None)

    async def set_serving(self, serving: bool) -> None:
        serving = serving and not self.draining  # once stopping, never SERVING again
        self.serving = serving
        if serving:
            # Watched from the first time it serves: loading a checkpoint's tokenizer may hold the GIL for
            # seconds before then, while only health checks wait (NOT_SERVING) and no request does.
            self.loop_lag.start()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def run_until_signal(self, on_stop: Callable[[], Awaitable[None]] | None = None,
                               on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM/SIGINT, then drain: NOT_SERVING, refuse new calls, let in-flight ones finish.

        `on_drain` runs beside the gRPC drain once NOT_SERVING is set: another front of the same
        process drains at the same time, or streams that would never finish (watches) end; `on_stop`
        runs after both.
        """
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serving = asyncio.ensure_future(self.server.wait_for_termination())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
        log.info("stopping: draining in-flight calls for up to %.0f s", self.config.grace_period_s)
        self.draining = True
        await self.set_serving(False)
        other_front = asyncio.ensure_future(on_drain()) if on_drain is not None else None
        await self.server.stop(self.config.grace_period_s)  # at once: new calls are refused from here on
        if other_front is not None:
            await other_front
        if on_stop is not None:
            await on_stop()
        stopping.cancel()
        await self.loop_lag.stop()
        log.info("stopped")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
