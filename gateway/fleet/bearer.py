"""The client side of rpcserver.auth: channel interceptors that send `authorization: Bearer <key>` on every call."""
from __future__ import annotations

import grpc


class _WithKey:
    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("empty API key")
        self._header = ("authorization", f"Bearer {api_key}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._header)
        return details._replace(metadata=metadata)


# grpc.aio files an interceptor under the first of the four kinds it is, so each kind is its own class.
class _UnaryUnary(_WithKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_WithKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_WithKey, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_WithKey, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(api_key: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for grpc.aio channels that send `api_key`; none without one, so calls keep grpc's plain,
    cheaper path when no key is set."""
    if not api_key:
        return []
    return [kind(api_key) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
