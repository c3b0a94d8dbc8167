"""The event-loop lag monitor: a loop blocked by synchronous work is seen, counted, logged and exported."""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import REGISTRY, generate_latest

from rpcserver.config import ServerConfig
from rpcserver.loop_lag import LoopLagMonitor
from rpcserver.server import GrpcServer

BLOCK_S = 0.3


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def next_wake(monitor: LoopLagMonitor) -> None:
    """Until the monitor has measured one more lag: it is then asleep again, waiting for the loop."""
    seen = monitor.wakes
    while monitor.wakes == seen:
        await asyncio.sleep(0.001)


async def block_the_loop(monitor: LoopLagMonitor) -> None:
    await next_wake(monitor)
    time.sleep(BLOCK_S)  # what a handler doing CPU work on the loop does to every other call
    await next_wake(monitor)


def test_a_blocked_loop_is_counted_logged_and_exported(caplog):
    stalls, over_250ms = sample("vllm_v0_event_loop_stalls_total"), (
        sample("vllm_v0_event_loop_lag_seconds_count") - sample("vllm_v0_event_loop_lag_seconds_bucket", le="0.25"))

    async def main():
        monitor = LoopLagMonitor()
        monitor.start()
        try:
            await block_the_loop(monitor)
        finally:
            await monitor.stop()
        return monitor

    with caplog.at_level(logging.WARNING, logger="rpcserver.loop_lag"):
        monitor = asyncio.run(main())
    # The monitor's sleep began before the block, so it woke at least the block minus its interval late.
    assert monitor.max_lag_s >= BLOCK_S - monitor.interval_s
    assert sample("vllm_v0_event_loop_stalls_total") >= stalls + 1
    assert sample("vllm_v0_event_loop_max_lag_seconds") >= monitor.max_lag_s
    assert (sample("vllm_v0_event_loop_lag_seconds_count") - sample("vllm_v0_event_loop_lag_seconds_bucket", le="0.25")
            >= over_250ms + 1)
    warnings = [r for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert warnings and any(int(r.getMessage().split("for ")[1].split(" ms")[0]) >= (BLOCK_S - monitor.interval_s) * 1000
                            for r in warnings)


def hold_the_loop_in_a_handler() -> None:
    time.sleep(BLOCK_S)


def test_a_stall_is_logged_with_what_held_the_loop(caplog):
    async def main():
        monitor = LoopLagMonitor()
        monitor.start()
        try:
            await next_wake(monitor)
            hold_the_loop_in_a_handler()
            await next_wake(monitor)
            await next_wake(monitor)  # an ordinary wake after it: no stack
        finally:
            await monitor.stop()

    with caplog.at_level(logging.WARNING, logger="rpcserver.loop_lag"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert len(warnings) == 1, warnings
    at = warnings[0].split("the loop thread was at:\n", 1)[1]
    assert "hold_the_loop_in_a_handler" in at and "time.sleep(BLOCK_S)" in at


def test_a_lag_under_the_threshold_is_measured_but_not_a_stall(caplog):
    monitor, stalls = LoopLagMonitor(), sample("vllm_v0_event_loop_stalls_total")
    with caplog.at_level(logging.WARNING, logger="rpcserver.loop_lag"):
        monitor.observe(monitor.stall_s / 2)
    assert (monitor.wakes, monitor.max_lag_s) == (1, monitor.stall_s / 2)
    assert sample("vllm_v0_event_loop_stalls_total") == stalls
    assert not [r for r in caplog.records if "event loop stalled" in r.getMessage()]


def test_every_server_runs_one_and_exports_the_names_the_harness_reads():
    async def main():
        server = GrpcServer(ServerConfig("127.0.0.1", 0, 1.0, 1 << 20, None, None, None, "INFO"), [])
        await server.start()
        # Watched once it serves: before, only health checks wait on a loop that loads a checkpoint.
        assert server.loop_lag._task is None
        await server.set_serving(True)
        try:
            await block_the_loop(server.loop_lag)
        finally:
            await server.close()
        return server

    server = asyncio.run(main())
    assert server.loop_lag.max_lag_s >= BLOCK_S - server.loop_lag.interval_s
    assert server.loop_lag._task is None  # stopped with the server
    page = generate_latest(REGISTRY).decode()
    for name in ("vllm_v0_event_loop_lag_seconds_bucket{le=\"0.25\"}", "vllm_v0_event_loop_stalls_total",
                 "vllm_v0_event_loop_max_lag_seconds"):
        assert name in page
