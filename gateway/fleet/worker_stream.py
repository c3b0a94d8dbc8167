"""A request's stream on the workers: routed to one, and carried to another when the one it is on fails."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.fleet.fleet_metrics import RESUMED, RETRIED, ROUTED
from gateway.fleet.step_stream import CallSteps
from gateway.fleet.worker_mux import CallBroken, MuxRequest, WorkerMux
from gateway.fleet.workers import Fleet, Worker, next_worker
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


# Why a stream left the worker it was on: the label of the resume counter, and the words of its log line.
CAUSES = {
    "worker": "the call to it broke (it died, or its connection dropped)",
    "unavailable": "it ended the request UNAVAILABLE (its engine core is down, or it is draining)",
    "not_serving": "it stopped serving and sent nothing more",
    "ended": "it ended the stream without a finish reason",
}

class Moved(Exception):
    """Ends the reading of a stream that the fleet moves off a worker that stopped serving."""


class WorkerStream:
    """One request on a worker the router picks, carried on elsewhere when that worker fails it.

    A stream that breaks UNAVAILABLE, ends without a finish reason, or is stranded on a worker that
    stopped serving goes on, up to `resume.max_resumes` times, on another serving worker (or on the same
    one once it serves again), within `resume.wait_s` and the request's deadline. The worker gets the ids
    the stream already yielded as `output_token_ids` and continues after them, so the reader sees one
    stream: no token twice, none missing. Any other error is the request's own and ends it.
    """

    def __init__(self, fleet: Fleet, work: worker_pb2.GenerateRequest, timeout: float | None,
                 open_call: OpenCall = generate_call, resume: ResumePolicy = ResumePolicy()):
        self.fleet = fleet
        self.resume = resume
        self.work = work
        self.open_call = open_call
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.generated: list[int] = []  # every token id yielded so far, on whichever workers
        self.resumes = 0
        self.last_step = time.monotonic()  # when the current worker last sent a step (or was given the request)
        self._call = None
        self._worker: Worker | None = None
        self._cancelled = False

    @property
    def worker(self) -> Worker | None:
        """The worker the stream is on now; None between workers."""
        return self._worker

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._release()

    def hold(self, until: float) -> None:
        """The next batch is taken no sooner than `until` (loop time), unless the stream ends first."""
        if self._call is not None:
            self._call.hold(until)

    def move(self) -> None:
        """Leave the current worker now (it stopped serving) and go on on another."""
        call = self._call
        if call is None or self._worker is None or self._cancelled:
            return
        call.buffer.end(Moved())  # first: a cancel may end the buffer without an error
        call.cancel()

    def _release(self) -> None:
        if self._worker is not None:
            self._worker.in_flight -= 1
            self._worker.streams.discard(self)
            self._worker = None

    def __aiter__(self):
        return self._each()

    async def _each(self):
        async for batch in self.batches():
            for step in batch:
                yield step

    async def batches(self):
        """The steps in batches: each holds every step that came since the previous one was taken."""
        failed: dict[str, int] = {}  # address -> its health checks done when it failed this request
        while not self._cancelled:
            worker = await self._next_worker(failed)
            worker.in_flight += 1
            worker.streams.add(self)
            self._worker = worker
            ROUTED.labels(worker.address).inc()
            timeout = max(0.0, self.deadline - time.monotonic()) if self.deadline is not None else None
            self.last_step = time.monotonic()
            self._call = self.open_call(worker, self._attempt(), timeout)
            finished = False
            try:
                async for batch in self._call.batches():
                    self.last_step = time.monotonic()
                    self.generated.extend(step.token_id for step in batch)
                    finished = bool(batch[-1].finish_reason)
                    yield batch
                if finished or self._cancelled:
                    return
                cause, error = "ended", Unavailable("the model worker ended the stream without a finish reason")
            except Moved:
                cause, error = "not_serving", Unavailable(f"the model worker {worker.address} stopped serving")
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                worker.wake()  # it may be gone: take it out of the rotation now, not at the next check
                cause, error = ("worker" if isinstance(e, CallBroken) else "unavailable"), e
            finally:
                self._release()
            if self._cancelled:
                return
            failed[worker.address] = worker.checks
            if self.resumes >= self.resume.max_resumes:
                if self.resume.max_resumes:
                    log.warning("request %s: worker %s failed it: %s, after %d resumes; giving up",
                                self.work.request_id, worker.address, CAUSES[cause], self.resumes)
                raise error
            self.resumes += 1
            RESUMED.labels(cause).inc()
            if not self.generated:
                RETRIED.labels(worker.address).inc()
            log.warning("request %s: worker %s failed it after %d tokens: %s; resuming (%d of at most %d)",
                        self.work.request_id, worker.address, len(self.generated), CAUSES[cause], self.resumes,
                        self.resume.max_resumes)

    def _attempt(self) -> worker_pb2.GenerateRequest:
        """The request as the next worker gets it: after the ids already generated, under an id of its own."""
        if not self.resumes:
            return self.work
        work = worker_pb2.GenerateRequest()
        work.CopyFrom(self.work)
        # A worker may still hold the attempt it failed (its cancel on the way): the new one must not clash.
        work.request_id = f"{self.work.request_id}.{self.resumes}"
        if self.generated:
            work.output_token_ids.extend(self.generated)
            work.ClearField("prompt_logprobs")  # they went out with the first token
        return work

    async def _next_worker(self, failed: dict[str, int]) -> Worker:
        """A serving worker for the request (workers.next_worker): only workers that have its adapter loaded can
        go on with it, and the cached blocks of its prompt and of the tokens generated so far count for routing."""
        return await next_worker(self.fleet, [*self.work.prompt_token_ids, *self.generated], failed,
                                 self.resume.wait_s, self.deadline, self.work.adapter)
