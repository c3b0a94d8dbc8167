"""--nice through the real services: every thread of the tokenizer and gateway runs lower, the worker's do not."""
from __future__ import annotations

import os

import grpc
import pytest

from tests.integration.stack import child_pids, make_stack, thread_nice
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads each thread's nice from /proc")


def test_the_tokenizer_and_gateway_run_lower_and_the_worker_and_its_engine_core_do_not(checkpoint, tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 13:
        pytest.skip(f"this run is already at nice {base}")
    stack = make_stack(str(checkpoint), str(tmp_path), tokenizer_flags=["--nice", "6"], gateway_flags=["--nice", "6"])
    stack.start()
    try:
        # A streamed request first, so the threads that serving starts (gRPC's, the tokenizer's pool) exist too.
        with grpc.insecure_channel(stack.gateway.address) as channel:
            replies = list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt="Hello there", max_tokens=4, temperature=0, ignore_eos=True),
                timeout=60))
        assert sum(len(r.token_ids) for r in replies) == 4
        for service in (stack.tokenizer, stack.gateway):
            threads = thread_nice(service.process.pid)
            assert len(threads) >= 2 and set(threads.values()) == {base + 6}, (service.name, threads)
            assert "CPU priority lowered by 6" in service.log()
        (core,) = child_pids(stack.worker.process.pid)
        for pid in (stack.worker.process.pid, core):
            assert set(thread_nice(pid).values()) == {base}
    finally:
        stack.stop()
