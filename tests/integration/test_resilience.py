"""Failures clients cause or suffer: cancels, deadlines, crashes, shutdowns, frozen clients, big messages."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.stack import ROOT, Service, Stack, child_pids, make_stack, wait_serving
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

GRACE_PERIOD_S = 5.0
MAX_MESSAGE_BYTES = 64 << 10
# Several seconds of generation for one stream here (the tiny model makes a few hundred tokens a
# second across all streams), so a stream asked for this many is in flight whenever a test acts on it.
LONG = 900
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def own_stack(checkpoint, tmp_path_factory):
    """This module's stack, never the shared one: the tests below kill, stop and restart its services."""
    logs = tmp_path_factory.mktemp("resilience-logs")
    stack = make_stack(str(checkpoint), str(logs), worker_flags=["--max-waiting", "64"],
                       gateway_flags=["--health-interval", "0.2", "--keepalive-time", "1", "--keepalive-timeout", "1",
                                      "--max-message-bytes", str(MAX_MESSAGE_BYTES),
                                      # A stream whose only tokenizer died waits this long for one, then fails.
                                      "--resume-wait", "2"],
                       common_flags=["--grace-period", str(GRACE_PERIOD_S)])
    try:
        for service in stack.services:
            service.start()
        for service in stack.services:
            wait_up(service)
        yield stack
    finally:
        stack.stop()


@pytest.fixture()
def healthy(own_stack: Stack) -> Stack:
    """The module's stack with all three services up, the gateway serving and the worker idle."""
    for service in own_stack.services:
        if service.process.poll() is not None:
            service.start()
    for service in own_stack.services:
        wait_up(service)
    # A first request also warms the worker, so timings below are not a cold start's.
    with gateway_channel(own_stack) as gateway:
        code, messages = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt="warm up", max_tokens=2),
                                                timeout=60))
    assert code == grpc.StatusCode.OK and sum(len(m.token_ids) for m in messages) == 2
    info = wait_for(lambda: worker_info(own_stack), idle, timeout=5)
    assert idle(info), info
    return own_stack


def wait_up(service: Service, timeout: float = 120) -> None:
    """Wait until `service` is SERVING; fail at once, with its log, if its process exits instead."""
    deadline = time.monotonic() + timeout
    while True:
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited with {service.process.returncode}:\n{service.log()[-3000:]}")
        try:
            return wait_serving(service.address, timeout=1)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


@contextlib.contextmanager
def gateway_channel(stack: Stack):
    with grpc.insecure_channel(stack.gateway.address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def worker_info(stack: Stack) -> worker_pb2.GetInfoResponse:
    with grpc.insecure_channel(stack.worker.address) as channel:
        return worker_pb2_grpc.ModelWorkerServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)


def idle(info: worker_pb2.GetInfoResponse) -> bool:
    return (info.running, info.waiting, info.kv_blocks_used) == (0, 0, 0)


def wait_for(read, done, timeout: float, interval: float = 0.05):
    """Call `read` until `done(value)` or `timeout` seconds pass; return the last value."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(interval)
        value = read()
    return value


def drain(call) -> tuple[grpc.StatusCode, list[gateway_pb2.GenerateResponse]]:
    """Read a stream to its end: its status and the messages it carried.

    A stream that ends OK must end with a finish reason: an OK without one is a cut stream
    passed off as a complete answer.
    """
    messages = []
    try:
        for message in call:
            messages.append(message)
    except grpc.RpcError as error:
        return error.code(), messages
    assert messages and messages[-1].finish_reason, "a stream ended OK without a finish reason"
    return grpc.StatusCode.OK, messages


def long_request(prompt: str, max_tokens: int = LONG) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0)


def start_streams(gateway, count: int, max_tokens: int = LONG, timeout: float = 60) -> list:
    """Open `count` streams and wait until each has produced a token."""
    calls = [gateway.Generate(long_request(f"stream {i} tells a long story", max_tokens), timeout=timeout)
             for i in range(count)]
    for call in calls:
        assert next(call).token_ids
    return calls


def token_count(messages) -> int:
    return sum(len(m.token_ids) for m in messages)


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- cancellation and deadlines -------------------------------------------------------------------------


def test_cancelled_streams_free_the_worker_within_a_second(healthy):
    clients = 16
    before = worker_info(healthy).tokens_after_cancel

    def first_token_then_cancel(i: int) -> int:
        call = gateway.Generate(long_request(f"client {i} leaves early"), timeout=60)
        first = next(call)
        call.cancel()
        return len(first.token_ids)

    with gateway_channel(healthy) as gateway, ThreadPoolExecutor(clients) as pool:
        assert list(pool.map(first_token_then_cancel, range(clients))) == [1] * clients
    info = wait_for(lambda: worker_info(healthy), idle, timeout=1.0)
    assert idle(info), f"1 s after {clients} cancels the worker still holds: {info}"
    # Tokens the worker computed for a caller that had already gone: a step or two per stream at most.
    wasted = info.tokens_after_cancel - before
    assert wasted <= 2 * clients, f"{wasted} tokens generated after {clients} streams were cancelled"


def test_deadline_ends_a_long_generation_and_frees_the_worker(healthy):
    deadline_s = 0.5
    with gateway_channel(healthy) as gateway:
        code, messages = drain(gateway.Generate(long_request("a story without end", max_tokens=1000),
                                                timeout=deadline_s))
    # Cut part-way: it had started streaming, and ended by its deadline, not by finishing its 1000 tokens.
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert messages, "the deadline should cut a stream that had started"
    assert token_count(messages) < 1000
    info = wait_for(lambda: worker_info(healthy), idle, timeout=1.0)
    assert idle(info), f"the worker kept the expired sequence: {info}"


# -- a downstream service dies ----------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["worker", "tokenizer"])
def test_downstream_crash_fails_streams_and_gateway_recovers(healthy, victim):
    service = getattr(healthy, victim)
    with gateway_channel(healthy) as gateway:
        # Their deadline bounds the wait: a stream that hung instead of failing would end DEADLINE_EXCEEDED.
        calls = start_streams(gateway, 4, timeout=30)
        service.stop(signal.SIGKILL)
        with ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(drain, calls))
        assert [code for code, _ in results] == [grpc.StatusCode.UNAVAILABLE] * len(calls)
        wait_serving(healthy.gateway.address, timeout=3, want=NOT_SERVING)

        # While it is down, a new request fails with UNAVAILABLE instead of hanging until its deadline.
        code, _ = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt="anyone there?", max_tokens=2),
                                         timeout=30))
        assert code == grpc.StatusCode.UNAVAILABLE

        service.start()  # same port: the gateway must find it again on its own
        wait_up(service)
        wait_serving(healthy.gateway.address, timeout=10)
        code, messages = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt="back again", max_tokens=4,
                                                                            ignore_eos=True), timeout=30))
    assert code == grpc.StatusCode.OK and token_count(messages) == 4
    # When the tokenizer died the worker was still generating: the gateway must have cancelled those streams.
    info = wait_for(lambda: worker_info(healthy), idle, timeout=2)
    assert idle(info), info


def test_killed_engine_core_is_restarted_and_its_streams_go_on_whole(healthy):
    """The worker carries its streams on to the core it restarts (--max-resumes): each caller sees one stream,
    with exactly the tokens an unbroken run of its request gives."""
    (core,) = child_pids(healthy.worker.process.pid)
    requests = [long_request(f"stream {i} tells a long story") for i in range(3)]
    with gateway_channel(healthy) as gateway, grpc.insecure_channel(healthy.worker.address) as worker_channel:
        watch = health_pb2_grpc.HealthStub(worker_channel).Watch(health_pb2.HealthCheckRequest(), timeout=180)
        assert next(watch).status == SERVING
        # The deadline bounds the wait: a stream the core's death left hanging fails the test as DEADLINE_EXCEEDED.
        calls = [gateway.Generate(request, timeout=120) for request in requests]
        firsts = [list(next(call).token_ids) for call in calls]
        os.kill(core, signal.SIGKILL)
        with ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(drain, calls))
        assert [code for code, _ in results] == [grpc.StatusCode.OK] * len(calls)
        assert next(watch).status == NOT_SERVING
        assert next(watch).status == SERVING  # restarted in the same worker process
        watch.cancel()
        got = [first + [t for m in messages for t in m.token_ids] for first, (_, messages) in zip(firsts, results)]
        unbroken = []
        for request in requests:
            code, messages = drain(gateway.Generate(request, timeout=120))
            assert code == grpc.StatusCode.OK
            unbroken.append([t for m in messages for t in m.token_ids])
    assert got == unbroken and all(len(tokens) == LONG for tokens in got)
    new_cores = child_pids(healthy.worker.process.pid)
    assert not is_running(core) and len(new_cores) == 1 and new_cores != [core]
    assert healthy.worker.process.poll() is None
    log = healthy.worker.log()
    assert "was killed by SIGKILL: 3 open streams wait for the next engine core" in log


# -- graceful shutdown ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stopped", ["gateway", "worker"])
def test_sigterm_finishes_in_flight_streams_and_refuses_new_calls(healthy, stopped):
    service = getattr(healthy, stopped)
    children = child_pids(service.process.pid)  # the worker's engine core must not outlive it
    assert len(children) == (1 if stopped == "worker" else 0)
    # Short enough to finish well inside the grace period, long enough to be in flight at SIGTERM.
    drain_tokens = 60
    signalled = False
    try:
        with gateway_channel(healthy) as gateway, grpc.insecure_channel(service.address) as service_channel:
            watch = health_pb2_grpc.HealthStub(service_channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == SERVING
            calls = start_streams(gateway, 4, max_tokens=drain_tokens, timeout=30)
            assert worker_info(healthy).running > 0, "the streams finished before SIGTERM; nothing to drain"
            service.process.send_signal(signal.SIGTERM)
            signalled = True

            # Watchers are told at once...
            assert next(watch).status == NOT_SERVING
            watch.cancel()
            # ...and new calls, on a fresh connection or through the gateway, are refused with UNAVAILABLE.
            with grpc.insecure_channel(service.address) as fresh, pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            code, _ = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt="too late", max_tokens=2),
                                             timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE

            with ThreadPoolExecutor(len(calls)) as pool:
                results = list(pool.map(drain, calls))
        for code, messages in results:
            assert code == grpc.StatusCode.OK
            assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
            assert token_count(messages) == drain_tokens - 1  # the first token was read before SIGTERM
    finally:
        if signalled:  # whatever failed, leave it stopped for the next test's fixture to restart
            try:  # the wait is bounded: a server that outlives its grace period fails here
                returncode = service.process.wait(timeout=GRACE_PERIOD_S + 5)
            finally:
                service.stop(signal.SIGKILL)
    assert returncode == 0, service.log()[-2000:]
    assert not [pid for pid in children if is_running(pid)], f"{stopped} left child processes behind"


# -- a client that vanishes without closing ---------------------------------------------------------------

VANISHING_CLIENT = """
import sys
import grpc
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(sys.argv[1]))
streams = [stub.Generate(gateway_pb2.GenerateRequest(prompt=f"never read {i}", max_tokens=1000, ignore_eos=True))
           for i in range(int(sys.argv[2]))]
for stream in streams:
    next(stream)
print("streaming", flush=True)
for stream in streams:
    for _ in stream:
        pass
"""


def test_keepalive_cancels_the_streams_of_a_frozen_client(healthy):
    streams = 4
    client = subprocess.Popen([sys.executable, "-c", VANISHING_CLIENT, healthy.gateway.address, str(streams)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert client.stdout.readline().strip() == "streaming"
        # Frozen, not closed: its sockets stay open and no FIN or RST tells the gateway it is gone.
        client.send_signal(signal.SIGSTOP)
        assert worker_info(healthy).running == streams
        # 1 s pings with a 1 s timeout: the gateway should give up within a few seconds, long before
        # 4000 tokens could have been generated here.
        info = wait_for(lambda: worker_info(healthy), idle, timeout=5, interval=0.2)
        assert idle(info), f"the frozen client's streams are still generating: {info}"
        assert client.poll() is None  # still frozen: it was the server that noticed
    finally:
        client.kill()
        client.wait(timeout=10)


# -- message size limits ---------------------------------------------------------------------------------


def test_oversized_request_is_resource_exhausted_and_server_keeps_serving(healthy):
    with gateway_channel(healthy) as gateway:
        # Just under the limit the request reaches the gateway's own checks (too many tokens)...
        under = "word " * ((MAX_MESSAGE_BYTES - 1024) // 5)
        code, _ = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt=under, max_tokens=2), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # ...just over it, gRPC refuses it before any handler runs.
        over = "word " * ((MAX_MESSAGE_BYTES + 1024) // 5)
        code, _ = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt=over, max_tokens=2), timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        code, messages = drain(gateway.Generate(gateway_pb2.GenerateRequest(prompt="a normal request", max_tokens=3,
                                                                            ignore_eos=True), timeout=30))
    assert code == grpc.StatusCode.OK and token_count(messages) == 3
