"""Register a servicer so that a request whose bytes do not parse reaches it as a MalformedRequest."""
from __future__ import annotations

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass


class MalformedRequest:
    """Stands in for a request that failed to parse, e.g. invalid UTF-8 in a string field.

    gRPC's own handling answers such a request with INTERNAL; letting the servicer see it
    turns it into INVALID_ARGUMENT like every other bad input (see rpcserver.status).
    """

    def __init__(self, type_name: str, error: Exception):
        self.type_name = type_name
        self.error = error


def _tolerant(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, e)
    return parse


# (client streaming, server streaming) -> handler factory
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(server: grpc.aio.Server, service: _descriptor.ServiceDescriptor, servicer) -> None:
    """What the generated add_*Servicer_to_server does, with tolerant request parsing."""
    handlers = {}
    for method in service.methods:
        make = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=_tolerant(GetMessageClass(method.input_type)),
                                     response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
