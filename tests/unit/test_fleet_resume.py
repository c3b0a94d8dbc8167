"""The fleet's side of resuming: a worker that stops serving is seen at once, and its stranded streams move."""
from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.fleet.router import Router
from gateway.fleet.workers import NOT_SERVING, SERVING, STRANDED_S, Fleet, Worker
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

WAIT_S = 5.0  # bounded waits on conditions, never a measure of speed


async def until(condition, timeout=WAIT_S) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


class Stream:
    """What the fleet sees of a WorkerStream: when its worker last sent a step, and move()."""

    def __init__(self, last_step: float):
        self.last_step, self.moved = last_step, 0

    def move(self):
        self.moved += 1


async def fleet_of(*states: str) -> Fleet:
    """A started fleet of workers in these states (never checked: their addresses lead nowhere)."""
    fleet = Fleet([], grpc.aio.insecure_channel, 30.0, Router())
    await fleet.start()
    for i, state in enumerate(states):
        worker = Worker(f"127.0.0.1:{i + 1}", grpc.aio.insecure_channel(f"127.0.0.1:{i + 1}"), 30.0)
        worker.state = state
        fleet.workers[worker.address] = worker
    return fleet


def test_streams_stuck_on_a_worker_that_stopped_serving_move_while_another_serves():
    async def run():
        fleet = await fleet_of(NOT_SERVING, SERVING)
        down, up = fleet.workers.values()
        stuck, busy = Stream(time.monotonic() - 2 * STRANDED_S), Stream(time.monotonic() + 60)
        down.streams.update({stuck, busy})  # `busy` still gets steps: a draining worker finishing its streams
        down.load.running = 1  # ...and a draining worker reports what it runs: nothing moves
        await asyncio.sleep(3 * STRANDED_S)
        assert stuck.moved == 0
        down.load.running = 0  # its engine core died: the worker reports nothing running
        try:
            await until(lambda: stuck.moved)
            await asyncio.sleep(3 * STRANDED_S)
            assert busy.moved == 0
            # With no other worker serving, nothing moves: the stream waits for its worker's new engine core.
            up.state = NOT_SERVING
            alone = Stream(time.monotonic() - 2 * STRANDED_S)
            down.streams = {alone}
            await asyncio.sleep(3 * STRANDED_S)
            assert alone.moved == 0
            up.state = SERVING
            await until(lambda: alone.moved)
        finally:
            await fleet.close()
    asyncio.run(run())


def test_wait_for_change_ends_at_a_health_check_or_a_state_change():
    async def run():
        fleet = await fleet_of(NOT_SERVING)
        worker = next(iter(fleet.workers.values()))
        waiting = asyncio.ensure_future(fleet.wait_for_change(WAIT_S))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        worker.on_checked = fleet._notify
        worker.on_checked()  # a check completed
        await asyncio.wait_for(waiting, WAIT_S)
        assert worker._wake.is_set()  # the workers not serving were asked to check at once
        await fleet.close()
    asyncio.run(run())


class Info(worker_pb2_grpc.ModelWorkerServiceServicer):
    async def GetInfo(self, request, context):
        return worker_pb2.GetInfoResponse(model="m", max_context=64)


def test_a_worker_saying_not_serving_is_out_of_the_rotation_before_its_next_check():
    async def run():
        server = grpc.aio.server()
        status = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(status, server)
        worker_pb2_grpc.add_ModelWorkerServiceServicer_to_server(Info(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await status.set("", health_pb2.HealthCheckResponse.SERVING)
        address = f"127.0.0.1:{port}"
        # Checks every 60 s: only the Watch stream can tell it within the test's waits.
        worker = Worker(address, grpc.aio.insecure_channel(address), 60.0)
        worker.start()
        try:
            await until(lambda: worker.serving)
            await asyncio.sleep(0.1)  # the Watch stream is open
            await status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # its engine core died
            await until(lambda: worker.state == NOT_SERVING, timeout=2.0)
            await status.set("", health_pb2.HealthCheckResponse.SERVING)  # its new core is up
            worker.wake()  # coming back is the checks' to see (a stream waiting for it wakes them every 0.2 s)
            await until(lambda: worker.serving, timeout=2.0)
            await asyncio.sleep(0.1)  # a new Watch stream is open: it tells the next death at once too
            await status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(lambda: worker.state == NOT_SERVING, timeout=2.0)
        finally:
            await worker.close()
            await server.stop(None)
    asyncio.run(run())
