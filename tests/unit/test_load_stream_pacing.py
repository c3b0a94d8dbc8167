"""The gateway's load stream to a worker (Worker._follow_load): one that ends at once never turns into a loop of
calls. Before, each end woke a health check, which opened the next stream: a worker without WatchLoad took
hundreds of calls a second and their server-side error logs, enough to stall a test's event loop for minutes."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gateway.fleet.router import Router
from gateway.fleet.workers import Fleet
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

INTERVAL = 0.1


class ShortStreams(worker_pb2_grpc.ModelWorkerServiceServicer):
    """A worker whose WatchLoad ends at once: refused as UNIMPLEMENTED, or closed with one update or none."""

    def __init__(self, end: str):
        self.end = end
        self.calls = 0

    async def GetInfo(self, request, context):
        return worker_pb2.GetInfoResponse(model="fake", max_context=1024)

    async def WatchLoad(self, request, context):
        self.calls += 1
        if self.end == "unimplemented":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no load stream here")
        if self.end == "after one update":
            yield worker_pb2.LoadUpdate(reset=True, block_size=16)


async def calls_in(servicer: ShortStreams, seconds: float, restart: bool = False) -> int:
    server = grpc.aio.server()
    worker_pb2_grpc.add_ModelWorkerServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    fleet = Fleet([address], grpc.aio.insecure_channel, INTERVAL, Router())
    await fleet.start()
    try:
        await asyncio.sleep(seconds)
        if restart:  # the worker stops serving and comes back: it may be another build now
            await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await asyncio.sleep(3 * INTERVAL)
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            await asyncio.sleep(3 * INTERVAL)
        return servicer.calls
    finally:
        await fleet.close()
        await server.stop(None)


@pytest.mark.parametrize("end", ["no update", "after one update"])
def test_a_stream_that_ends_at_once_reopens_once_an_interval_at_most(end):
    servicer = ShortStreams(end)
    calls = asyncio.run(calls_in(servicer, 1.0))
    assert 2 <= calls <= 1.0 / INTERVAL + 2, calls  # it is retried, but paced by the health checks


def test_a_worker_without_watch_load_is_asked_once_until_it_restarts():
    servicer = ShortStreams("unimplemented")
    assert asyncio.run(calls_in(servicer, 1.0)) == 1
    servicer = ShortStreams("unimplemented")
    assert asyncio.run(calls_in(servicer, 0.5, restart=True)) == 2
