"""Channels to the tokenizer service and the model workers, and the routed worker stream."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from gateway.fleet.bearer import bearer_interceptors
from gateway.fleet.fleet_metrics import RESUMED
from gateway.fleet.router import Router
from gateway.fleet.tokenizers import TokenizerPool
from gateway.fleet.worker_stream import (WORKER_STREAMS, MultiplexedCalls, OpenCall, ResumePolicy, WorkerStream,
                                         generate_call)
from gateway.fleet.workers import Fleet, parse_targets
from gateway.text.detokenize import Detokenizer
from rpcserver.pieces import GRPC_MESSAGE_BYTES
from rpcserver.shared import read_file
from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Notice a dead peer within seconds even while a stream is idle, so callers fail fast.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # The wait for a ping's ack is a separate setting (a minute by default); match it, so a
    # hung (not crashed) service is noticed in seconds too.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect quickly after a downstream restart instead of backing off for minutes: a stream waiting for
    # its worker or tokenizer to come back (--resume-wait) goes on at most half a second after it does.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.max_receive_message_length", 64 << 20),
]


@dataclass
class DownstreamTLS:
    ca: str | None = None     # verify the services' certificates against this CA
    cert: str | None = None   # present this client certificate (mTLS)
    key: str | None = None


def open_channel(address: str, tls: DownstreamTLS, api_key: str | None = None) -> grpc.aio.Channel:
    """A channel to a tokenizer or worker: TLS as `tls` says, sending `api_key` on every call when given."""
    if bool(tls.cert) != bool(tls.key):
        raise SystemExit("--downstream-tls-cert and --downstream-tls-key go together")
    # Metadata rather than call credentials: grpc sends those over TLS only, and the key is for plaintext too.
    interceptors = bearer_interceptors(api_key) or None
    if not tls.ca and not tls.cert:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(read_file(tls.ca), read_file(tls.key), read_file(tls.cert))
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors)


class Downstreams:
    """The tokenizers (a pool with the stub's surface), the fleet of workers, and facts fetched once they answer
    (context size, eos tokens)."""

    def __init__(self, tokenizer_targets: list[str] | str, worker_targets: list[str] | str, tls: DownstreamTLS,
                 health_interval: float = 1.0, router: Router | None = None, worker_stream: str = "multiplexed",
                 api_key: str | None = None, max_message_bytes: int = GRPC_MESSAGE_BYTES,
                 resume: ResumePolicy = ResumePolicy()):
        if worker_stream not in WORKER_STREAMS:
            raise ValueError(f"worker_stream must be one of {', '.join(WORKER_STREAMS)}, got {worker_stream!r}")
        self.tls = tls
        self.resume = resume
        self.max_message_bytes = max_message_bytes  # the workers' limit, taken as ours
        # One shared call per worker costs a message per engine step rather than one per request per step.
        self._open_call: OpenCall = (MultiplexedCalls(max_message_bytes) if worker_stream == "multiplexed"
                                     else generate_call)
        self.addresses = {"tokenizer": ",".join(parse_targets(tokenizer_targets)),
                          "worker": ",".join(parse_targets(worker_targets))}
        self.tokenizer = TokenizerPool(parse_targets(tokenizer_targets),
                                       lambda address: open_channel(address, tls, api_key), health_interval, resume)
        # One DecodeBatches call for every request's text; its messages kept within the limit, taken as ours.
        # When it breaks, a new one on a serving tokenizer carries every stream on.
        self.detokenizer = Detokenizer(self.tokenizer, max_message_bytes, resume, self.tokenizer.open_decode_batches,
                                       RESUMED.labels("tokenizer").inc)
        self.fleet = Fleet(parse_targets(worker_targets), lambda address: open_channel(address, tls, api_key),
                           health_interval, router or Router())
        self.token_text: dict[int, str] = {}  # special token id -> text, for stop reasons
        # The tokenizer's facts, as last fetched: an embedding checkpoint's prompts and pooling among them.
        self.tokenizer_info: tokenizer_pb2.GetInfoResponse | None = None

    async def start(self) -> None:
        await self.tokenizer.start()
        await self.fleet.start()

    @property
    def worker_info(self) -> worker_pb2.GetInfoResponse | None:
        """A serving worker's facts; with several, the one of smallest context, so every worker takes the limits."""
        infos = [w.info for w in self.fleet.serving() if w.info is not None]
        return min(infos, key=lambda info: info.max_context) if infos else None

    def open_worker_stream(self, work: worker_pb2.GenerateRequest, timeout: float | None) -> WorkerStream:
        """The worker's token stream for this request: async-iterable, with cancel()."""
        return WorkerStream(self.fleet, work, timeout, self._open_call, self.resume)

    def worker_statuses(self) -> list[gateway_pb2.WorkerStatus]:
        return [gateway_pb2.WorkerStatus(
            address=w.address, state=w.state, running=w.load.running, waiting=w.load.waiting,
            kv_blocks_used=w.load.kv_blocks_used, kv_blocks_free=w.load.kv_blocks_free,
            prefix_cache_hit_rate=w.load.prefix_cache_hit_rate, cached_blocks=len(w.blocks), in_flight=w.in_flight)
            for w in self.fleet.workers.values()]

    async def healthy(self) -> dict[str, bool]:
        """Whether any tokenizer and any worker serve, as their last health checks said."""
        return {"tokenizer": bool(self.tokenizer.serving()), "worker": bool(self.fleet.serving())}

    async def refresh_info(self, timeout: float = 5.0) -> None:
        info = await self.tokenizer.GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=timeout)
        self.token_text = {t.id: t.content for t in info.special_tokens}
        self.tokenizer_info = info

    async def close(self) -> None:
        await self.fleet.close()
        await self.detokenizer.close()
        await self.tokenizer.close()
