"""Health probe for containers: exits 0 only if a server's grpc.health.v1 Check says SERVING."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcserver.shared import read_file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rpcserver.healthcheck", description=__doc__)
    parser.add_argument("--addr", required=True, help="server host:port")
    parser.add_argument(
        "--service", default="", help="service name to check (default: '', the whole server)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    parser.add_argument("--tls-ca", metavar="FILE", help="root certificate: connect over TLS")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate, for a server that requires one (mTLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="key of --tls-cert")
    return parser.parse_args(argv)


def check(addr: str, service: str, timeout: float, tls_ca: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None) -> str:
    """The server's status name for `service`, e.g. "SERVING"; raises grpc.RpcError."""
    if tls_ca is None and tls_cert is None:
        channel = grpc.insecure_channel(addr)
    else:
        credentials = grpc.ssl_channel_credentials(read_file(tls_ca), read_file(tls_key), read_file(tls_cert))
        channel = grpc.secure_channel(addr, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        status = check(args.addr, args.service, args.timeout, args.tls_ca, args.tls_cert, args.tls_key)
    except grpc.RpcError as err:
        print(f"unhealthy: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"unhealthy: {err}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"unhealthy: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
