"""A request's stream on the workers: routed to one, and carried to another when the one it is on fails."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.fleet.fleet_metrics import RETRIED, ROUTED
from gateway.fleet.step_stream import CallSteps
from gateway.fleet.worker_mux import MuxRequest, WorkerMux
from gateway.fleet.workers import Fleet, Worker
from rpcserver.errors import Unavailable
from rpcserver.pieces import GRPC_MESSAGE_BYTES
from vllm_v0.worker.v1 import worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePolicy:
    """How far a stream goes to outlive what it runs on."""

    max_resumes: int = 3  # times one request is carried on after a failure; 0: never
    wait_s: float = 30.0  # longest wait for something to serve it again, within the request's deadline


# Starts a request on a worker: a StepStream (its steps in batches) with cancel(), failing as a Generate call does.
OpenCall = Callable[[Worker, worker_pb2.GenerateRequest, "float | None"], Any]
WORKER_STREAMS = ("multiplexed", "per-request")


def generate_call(worker: Worker, work: worker_pb2.GenerateRequest, timeout: float | None) -> CallSteps:
    """The request as its own Generate call, its prompt logprobs' pieces joined."""
    return CallSteps(worker.stub.Generate(work, timeout=timeout))


class MultiplexedCalls:
    """The request on the worker's shared GenerateMany call, opened on demand."""

    def __init__(self, max_message_bytes: int = GRPC_MESSAGE_BYTES):
        self._muxes: dict[str, tuple[Worker, WorkerMux]] = {}  # address -> the worker it was opened for, its mux
        self.max_message_bytes = max_message_bytes  # the most a start may take: the worker's limit, taken as ours

    def __call__(self, worker: Worker, work: worker_pb2.GenerateRequest, timeout: float | None) -> MuxRequest:
        known = self._muxes.get(worker.address)
        if known is None or known[0] is not worker:  # a worker that left and came back has a new channel
            known = self._muxes[worker.address] = (worker, WorkerMux(worker.stub.GenerateMany, worker.address,
                                                                          self.max_message_bytes))
        return known[1].open(work, timeout)


class WorkerStream:
    """One request on a worker the router picks, retried once on another when it fails UNAVAILABLE
    before its first token (the worker died or is draining); after the first token an error is the caller's.
    """

    def __init__(self, fleet: Fleet, work: worker_pb2.GenerateRequest, timeout: float | None,
                 open_call: OpenCall = generate_call, resume: ResumePolicy = ResumePolicy()):
        self.fleet = fleet
        self.resume = resume
        self.work = work
        self.open_call = open_call
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self._call = None
        self._worker: Worker | None = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._release()

    def _release(self) -> None:
        if self._worker is not None:
            self._worker.in_flight -= 1
            self._worker = None

    def __aiter__(self):
        return self._each()

    async def _each(self):
        async for batch in self.batches():
            for step in batch:
                yield step

    async def batches(self):
        """The steps in batches: each holds every step that came since the previous one was taken."""
        tried: list[str] = []
        while not self._cancelled:
            worker = self.fleet.pick(list(self.work.prompt_token_ids), exclude=tuple(tried))
            if worker is None:
                raise Unavailable("no model worker is serving" + (" besides one that failed" if tried else "")
                                  + "; retry shortly")
            tried.append(worker.address)
            worker.in_flight += 1
            self._worker = worker
            ROUTED.labels(worker.address).inc()
            timeout = max(0.0, self.deadline - time.monotonic()) if self.deadline is not None else None
            self._call = self.open_call(worker, self.work, timeout)
            first = True
            try:
                async for batch in self._call.batches():
                    first = False
                    yield batch
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                worker.wake()  # it may be gone: take it out of the rotation now, not at the next check
                if not first or len(tried) > 1 or self._cancelled:
                    raise
                RETRIED.labels(worker.address).inc()
                log.warning("request %s: worker %s is unavailable before the first token (%s); retrying on another",
                            self.work.request_id, worker.address, e.details())
            finally:
                self._release()
