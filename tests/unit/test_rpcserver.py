"""The shared server shape: a port already taken is an error at start, never a second listener beside the first."""
import asyncio
import gc

import grpc
import pytest

from rpcserver.collector import GC_YOUNG_THRESHOLD
from rpcserver.config import ServerConfig
from rpcserver.server import GrpcServer


def config(port: int) -> ServerConfig:
    return ServerConfig("127.0.0.1", port, 1.0, 1 << 20, None, None, None, "info")


def test_a_second_server_on_a_taken_port_fails_at_start():
    async def main():
        first = GrpcServer(config(0), [])
        port = await first.start()
        try:
            second = GrpcServer(config(port), [])
            with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: the address is already in use"):
                await second.start()
        finally:
            await first.server.stop(None)
        # Once the first has gone the port is free again: the failure was the clash, not the address.
        third = GrpcServer(config(port), [])
        assert await third.start() == port
        await third.server.stop(None)

    asyncio.run(main())


def test_a_started_server_freezes_what_lives_and_collects_young_objects_less_often():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # the interpreter's default (a server started before this test raised it)

    async def main():
        server = GrpcServer(config(0), [])
        await server.start()
        try:
            return gc.get_threshold(), gc.get_freeze_count()
        finally:
            await server.server.stop(None)

    try:
        threshold, frozen = asyncio.run(main())
    finally:
        gc.set_threshold(*before)
    assert threshold == (GC_YOUNG_THRESHOLD, 10, 10) and GC_YOUNG_THRESHOLD > 700
    assert frozen > 10_000  # the imports, at least, are out of the collector's way


def test_one_status_mapping_for_logs_and_metrics():
    from rpcserver.errors import InvalidArgument
    from rpcserver.status import code_for

    class Context:
        def code(self):
            return None

    context = Context()
    # Inside a servicer method, grpc_errors turns an unexpected exception into INTERNAL ...
    assert code_for(RuntimeError("bug"), context) == grpc.StatusCode.INTERNAL
    assert code_for(InvalidArgument("x"), context) == grpc.StatusCode.INVALID_ARGUMENT
    # ... while one that escaped the method reaches the client as grpc.aio's UNKNOWN.
    assert code_for(RuntimeError("bug"), context, handled=False) == grpc.StatusCode.UNKNOWN
    for handled in (True, False):
        assert code_for(asyncio.CancelledError(), context, handled) == grpc.StatusCode.CANCELLED
        assert code_for(None, context, handled) == grpc.StatusCode.OK
