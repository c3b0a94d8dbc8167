"""Command-line flags every server shares, each with an environment variable of the same name."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from rpcserver.version import add_version_flag

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """A byte count: a plain integer, or a number with a unit such as 512MiB, 2GiB, 1.5GB (B optional)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or e.g. 512MiB, 2GiB, 1.5GB")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def env_default(flag: str, default, convert=None):
    """Default for --some-flag from VLLM_V0_SOME_FLAG, else the given default."""
    value = os.environ.get("VLLM_V0_" + flag.lstrip("-").upper().replace("-", "_"))
    if value is None:
        return default
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if convert is not None:
        return convert(value)
    return type(default)(value) if default is not None else value


def add_flag(parser: argparse.ArgumentParser, flag: str, default, help: str, **kwargs) -> None:
    env = "VLLM_V0_" + flag.lstrip("-").upper().replace("-", "_")
    if isinstance(default, bool):
        parser.add_argument(flag, default=env_default(flag, default), action=argparse.BooleanOptionalAction,
                            help=f"{help} [env {env}]", **kwargs)
        return
    convert = kwargs.pop("type", type(default) if default is not None else str)
    parser.add_argument(flag, default=env_default(flag, default, convert), type=convert,
                        help=f"{help} (default: %(default)s) [env {env}]", **kwargs)


# (flag, lowest, highest): None is no bound. Ranges every server's own flags must fall in.
SERVER_FLAG_RANGES = (("--port", 0, 65535), ("--metrics-port", 0, 65535), ("--grace-period", 0, None),
                      ("--max-message-bytes", 1, None), ("--keepalive-time", 0.001, None),
                      ("--keepalive-timeout", 0.001, None))


def check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace, ranges) -> None:
    """Exit through parser.error, naming the flag, when a value is outside its (flag, lowest, highest) range."""
    for flag, low, high in ranges:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            parser.error(f"{flag} must be {bounds}, got {value}")


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
    # VLLM_V0_HOST, VLLM_V0_PORT and the other variables below are read by all three services alike:
    # services started from one shell need their own --port (and --host) on each command line.
    add_version_flag(parser, parser.prog)
    add_flag(parser, "--host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    add_flag(parser, "--port", default_port, "port to listen on (0 picks a free one)")
    add_flag(parser, "--grace-period", 30.0, "seconds in-flight calls may finish after SIGTERM")
    add_flag(parser, "--max-message-bytes", 4 << 20, "largest request or response message accepted: bytes, or "
             "a size such as 16MiB", type=parse_size)
    add_flag(parser, "--tls-cert", None, "PEM certificate chain: serve TLS instead of plaintext")
    add_flag(parser, "--tls-key", None, "PEM private key for --tls-cert")
    add_flag(parser, "--tls-client-ca", None, "PEM CA bundle: require clients to present a certificate it signed (mTLS)")
    add_flag(parser, "--keepalive-time", 20.0, "seconds between pings to each client connection, to notice "
             "clients that vanished without closing")
    add_flag(parser, "--keepalive-timeout", 10.0, "seconds a ping may go unanswered before the connection and "
             "its streams are dropped")
    add_flag(parser, "--log-level", "INFO", "logging level")
    add_flag(parser, "--metrics-port", 0, "serve Prometheus metrics over HTTP at --host:PORT/metrics (0: off)")
