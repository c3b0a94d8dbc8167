"""Optional API key for any server: `authorization: Bearer <key>` metadata, checked by an interceptor."""
from __future__ import annotations

import argparse
import hashlib
import hmac

import grpc

from rpcserver.config import env_default

# Left open on purpose. Orchestrators' liveness/readiness probes and grpcurl's discovery must work
# without the secret, and these two services reveal only service names, schemas and serving status,
# never a model's output or a request.
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})


def add_auth_flags(parser: argparse.ArgumentParser) -> None:
    # Not add_flag: its help would print the key taken from the environment as the default.
    parser.add_argument("--api-key", default=env_default("--api-key", None),
                        help="require 'authorization: Bearer KEY' on every call except health and reflection; "
                             "prefer the environment or --api-key-file, which `ps` does not show "
                             "[env VLLM_V0_API_KEY]")
    parser.add_argument("--api-key-file", default=env_default("--api-key-file", None),
                        help="read the API key from this file (surrounding whitespace ignored) "
                             "[env VLLM_V0_API_KEY_FILE]")


def api_key_from_args(args: argparse.Namespace) -> str | None:
    return read_api_key(args.api_key, args.api_key_file, "--api-key")


def read_api_key(key: str | None, key_file: str | None, flag: str) -> str | None:
    """The key given as `flag KEY` or `flag-file PATH` (exiting with a message if both or the file is bad)."""
    if key and key_file:
        raise SystemExit(f"give {flag} or {flag}-file, not both")
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise SystemExit(f"cannot read {flag}-file: {e}") from None
        if not key:
            raise SystemExit(f"{flag}-file {key_file} is empty")
        return key
    return key or None


def _digest(value: str) -> bytes:
    # Comparing fixed-length digests keeps even the key's length out of the timing.
    return hashlib.sha256(value.encode("utf-8")).digest()


def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails with `code` before reading anything."""
    async def unary_response(request, context):
        await context.abort(code, details)

    async def stream_response(request, context):
        await context.abort(code, details)
        yield  # never reached; makes this an async generator like the handler it replaces

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_response, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_response, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream_response, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary_response, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer key with UNAUTHENTICATED; OPEN_SERVICES pass freely."""

    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("empty API key")
        self._want = _digest(api_key)

    def _refusal(self, metadata) -> str | None:
        """Why the call is refused, or None to let it through."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            return "missing API key: send metadata 'authorization: Bearer <key>'"
        return self.refusal(values[0] if isinstance(values[0], str) else values[0].decode())

    def refusal(self, authorization: str | None) -> str | None:
        """Why an `authorization` value (gRPC metadata or HTTP header) is refused, or None if it is the key."""
        if not authorization:
            return "missing API key: send 'authorization: Bearer <key>'"
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "malformed authorization metadata: expected 'Bearer <key>'"
        if not hmac.compare_digest(_digest(key.strip()), self._want):
            return "invalid API key"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if handler is None or service in OPEN_SERVICES:
            return handler  # None: unknown method, answered UNIMPLEMENTED as usual
        refusal = self._refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED, refusal)


def auth_interceptors(args: argparse.Namespace) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors --api-key/--api-key-file ask for: none when neither is given."""
    key = api_key_from_args(args)
    return [ApiKeyInterceptor(key)] if key else []
