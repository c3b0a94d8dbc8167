"""Command-line flags every server shares, each with an environment variable of the same name."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


def env_default(flag: str, default):
    """Default for --some-flag from VLLM_V0_SOME_FLAG, else the given default."""
    value = os.environ.get("VLLM_V0_" + flag.lstrip("-").upper().replace("-", "_"))
    if value is None:
        return default
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    return type(default)(value) if default is not None else value


def add_flag(parser: argparse.ArgumentParser, flag: str, default, help: str, **kwargs) -> None:
    env = "VLLM_V0_" + flag.lstrip("-").upper().replace("-", "_")
    if isinstance(default, bool):
        parser.add_argument(flag, default=env_default(flag, default), action=argparse.BooleanOptionalAction,
                            help=f"{help} [env {env}]", **kwargs)
        return
    parser.add_argument(flag, default=env_default(flag, default), type=kwargs.pop("type", type(default) if default
                        is not None else str), help=f"{help} (default: %(default)s) [env {env}]", **kwargs)


@dataclass
class ServerConfig:
    host: str
    port: int
    grace_period_s: float
    max_message_bytes: int
    tls_cert: str | None
    tls_key: str | None
    tls_client_ca: str | None
    log_level: str
    keepalive_time_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    metrics_port: int = 0  # 0: no /metrics endpoint

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(args.host, args.port, args.grace_period, args.max_message_bytes, args.tls_cert, args.tls_key,
                   args.tls_client_ca, args.log_level, keepalive_time_s=args.keepalive_time,
                   keepalive_timeout_s=args.keepalive_timeout, metrics_port=args.metrics_port)


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    add_flag(parser, "--host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    add_flag(parser, "--port", default_port, "port to listen on (0 picks a free one)")
    add_flag(parser, "--grace-period", 30.0, "seconds in-flight calls may finish after SIGTERM")
    add_flag(parser, "--max-message-bytes", 4 << 20, "largest request or response message accepted")
    add_flag(parser, "--tls-cert", None, "PEM certificate chain: serve TLS instead of plaintext")
    add_flag(parser, "--tls-key", None, "PEM private key for --tls-cert")
    add_flag(parser, "--tls-client-ca", None, "PEM CA bundle: require clients to present a certificate it signed (mTLS)")
    add_flag(parser, "--keepalive-time", 20.0, "seconds between pings to each client connection, to notice "
             "clients that vanished without closing")
    add_flag(parser, "--keepalive-timeout", 10.0, "seconds a ping may go unanswered before the connection and "
             "its streams are dropped")
    add_flag(parser, "--log-level", "INFO", "logging level")
    add_flag(parser, "--metrics-port", 0, "serve Prometheus metrics over HTTP at --host:PORT/metrics (0: off)")
