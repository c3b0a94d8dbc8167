"""Runs the HTTP front with uvicorn on the gateway's own asyncio loop, beside the gRPC server."""
from __future__ import annotations

import asyncio
import contextlib
import ssl

import uvicorn

from rpcserver.config import ServerConfig


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):
        # The gateway's gRPC server owns SIGTERM/SIGINT and drains both fronts together.
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, config: ServerConfig, port: int, log_level: str):
        tls = {}
        if config.tls_cert:
            tls = dict(ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key)
            if config.tls_client_ca:
                tls.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.config = uvicorn.Config(
            app, host=config.host, port=port, lifespan="off", access_log=False, log_level=log_level.lower(),
            # Streams in flight get the same grace as gRPC's after SIGTERM.
            timeout_graceful_shutdown=int(config.grace_period_s), **tls)
        self.server = _EmbeddedServer(self.config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                # uvicorn logs why (usually the port is taken) and exits its serve().
                raise SystemExit(f"cannot serve HTTP on {self.config.host}:{self.config.port}")
            await asyncio.sleep(0.05)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        await self.task
