"""--engine-cpus: the engine core and every thread in it run on the given CPUs, restarted or not; the front on the others."""
from __future__ import annotations

import os
import signal
import time

import grpc

from services.model_worker.host.cpu_affinity import format_cpu_list
from tests.integration.stack import Service, child_pids, free_port, thread_status, wait_serving
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc


def thread_cpus(pid: int) -> dict[int, str]:
    """Each thread's Cpus_allowed_list, read from /proc."""
    return thread_status(pid, "Cpus_allowed_list")


def generate(worker: Service) -> None:
    with grpc.insecure_channel(worker.address) as channel:
        messages = list(worker_pb2_grpc.ModelWorkerServiceStub(channel).Generate(
            worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True), timeout=60))
    assert len(messages) == 4


def test_the_engine_core_runs_on_the_given_cpus_only(checkpoint, tmp_path):
    own = os.sched_getaffinity(0)
    cpu = max(own)
    worker = Service("worker", ["services.model_worker", "--model", str(checkpoint), "--dtype", "float32",
                                "--engine-cpus", str(cpu)], free_port(), str(tmp_path / "worker.log"))
    worker.start()
    try:
        wait_serving(worker.address, timeout=120)
        generate(worker)
        (core,) = child_pids(worker.process.pid)
        core_threads = thread_cpus(core)
        # The step loop, the command reader and the OpenMP team, all of them: pinned before they existed.
        assert len(core_threads) >= 2 and set(core_threads.values()) == {str(cpu)}, core_threads
        front = thread_cpus(worker.process.pid)
        # The front, gRPC's threads included, runs on the worker's other CPUs: none lands on the engine's.
        others = format_cpu_list(own - {cpu}) if len(own) > 1 else str(cpu)
        assert len(front) >= 2 and set(front.values()) == {others}, front
        assert f"engine core: CPUs {cpu}, threads 1" in worker.log()

        # A core the worker restarts after a crash runs on the same CPUs.
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (cores := child_pids(worker.process.pid)) in ([], [core]):
            assert time.monotonic() < deadline, "the worker did not restart its engine core"
            time.sleep(0.1)
        (restarted,) = cores
        wait_serving(worker.address, timeout=120)
        generate(worker)
        assert set(thread_cpus(restarted).values()) == {str(cpu)}
    finally:
        worker.stop()
