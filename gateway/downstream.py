"""Channels to the tokenizer service and the model worker, and a watch on their health."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcserver.shared import read_file
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Notice a dead peer within seconds even while a stream is idle, so callers fail fast.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # The wait for a ping's ack is a separate setting (a minute by default); match it, so a
    # hung (not crashed) service is noticed in seconds too.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect quickly after a downstream restart instead of backing off for minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.max_receive_message_length", 64 << 20),
]


@dataclass
class DownstreamTLS:
    ca: str | None = None     # verify the services' certificates against this CA
    cert: str | None = None   # present this client certificate (mTLS)
    key: str | None = None


def open_channel(address: str, tls: DownstreamTLS) -> grpc.aio.Channel:
    if bool(tls.cert) != bool(tls.key):
        raise SystemExit("--downstream-tls-cert and --downstream-tls-key go together")
    if not tls.ca and not tls.cert:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(read_file(tls.ca), read_file(tls.key), read_file(tls.cert))
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


class Downstreams:
    """Stubs for both services, plus facts fetched once they answer (context size, eos tokens)."""

    def __init__(self, tokenizer_addr: str, worker_addr: str, tls: DownstreamTLS):
        self.addresses = {"tokenizer": tokenizer_addr, "worker": worker_addr}
        self._channels = {name: open_channel(addr, tls) for name, addr in self.addresses.items()}
        self.tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(self._channels["tokenizer"])
        self.worker = worker_pb2_grpc.ModelWorkerServiceStub(self._channels["worker"])
        self._health = {name: health_pb2_grpc.HealthStub(ch) for name, ch in self._channels.items()}
        self.worker_info: worker_pb2.GetInfoResponse | None = None
        self.token_text: dict[int, str] = {}  # special token id -> text, for stop reasons

    async def healthy(self, timeout: float = 2.0) -> dict[str, bool]:
        async def check(name: str) -> bool:
            try:
                reply = await self._health[name].Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                return False
        names = list(self._health)
        return dict(zip(names, await asyncio.gather(*(check(n) for n in names))))

    async def refresh_info(self, timeout: float = 5.0) -> None:
        self.worker_info = await self.worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
        info = await self.tokenizer.GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=timeout)
        self.token_text = {t.id: t.content for t in info.special_tokens}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
