"""A worker with --tensor-parallel-size 2 (two CPU ranks on gloo): the end-to-end generate tests, a dead rank, SIGTERM."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.stack import child_pids, make_stack
from tests.integration.test_generate import *  # noqa: F401,F403 - the same tests, against this module's stack
from tests.integration.test_resilience import drain, is_running, start_streams
from vllm_v0.gateway.v1 import gateway_pb2_grpc

TP_FLAGS = ["--max-waiting", "64", "--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    """Overrides the shared stack for the generate tests imported above."""
    logs = tmp_path_factory.mktemp("tp-logs")
    stack = make_stack(str(checkpoint), str(logs), worker_flags=TP_FLAGS)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture()
def doomed_stack(checkpoint, tmp_path_factory):
    """A stack of its own, whose worker the test brings down."""
    logs = tmp_path_factory.mktemp("tp-doomed-logs")
    # Its only worker never comes back: the gateway's streams wait 2 s for one, not the default 30.
    stack = make_stack(str(checkpoint), str(logs), worker_flags=TP_FLAGS, gateway_flags=["--resume-wait", "2"])
    stack.start()
    yield stack
    stack.stop()


def worker_processes(stack) -> tuple[int, list[int]]:
    """The engine core (rank 0) and the other ranks it started."""
    (core,) = child_pids(stack.worker.process.pid)
    return core, child_pids(core)


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_worker_reports_two_ranks_in_its_log(stack):
    core, ranks = worker_processes(stack)
    assert len(ranks) == 1 and is_running(ranks[0])
    assert "started tensor-parallel ranks 1..1" in stack.worker.log()


def test_a_killed_rank_fails_the_streams_and_the_worker_exits(doomed_stack):
    core, (rank,) = worker_processes(doomed_stack)
    with grpc.insecure_channel(doomed_stack.gateway.address) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        # The deadline bounds the wait: a stream the rank's death did not end fails as DEADLINE_EXCEEDED.
        calls = start_streams(gateway, 2, timeout=15)
        os.kill(rank, signal.SIGKILL)
        with ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(drain, calls))
    assert [code for code, _ in results] == [grpc.StatusCode.UNAVAILABLE] * len(calls)
    assert all("no model worker could go on" in call.details() for call in calls)
    assert wait_until(lambda: doomed_stack.worker.process.poll() is not None, timeout=15)
    assert doomed_stack.worker.process.returncode != 0
    assert not is_running(core)
    assert "a tensor-parallel worker does not restart its ranks" in doomed_stack.worker.log()


def test_sigterm_stops_every_rank(stack):
    # Last in this module: it stops the module's worker.
    core, ranks = worker_processes(stack)
    stack.worker.process.send_signal(signal.SIGTERM)
    assert stack.worker.process.wait(30) == 0
    assert wait_until(lambda: not any(is_running(pid) for pid in (core, *ranks)), timeout=15)
