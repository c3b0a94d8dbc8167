"""One unary call on a worker the router picks (Embed, Score), tried again on another when that one is unavailable."""
from __future__ import annotations

import logging
import time

import grpc

from gateway.fleet.fleet_metrics import RETRIED, ROUTED
from gateway.fleet.worker_stream import ResumePolicy
from gateway.fleet.workers import Fleet, next_worker

log = logging.getLogger(__name__)

KINDS = {"Embed": "embed", "Score": "score"}  # each method's kind of request (Worker.serves)


async def call_worker(fleet: Fleet, resume: ResumePolicy, method: str, request, route_ids: list[int],
                      timeout: float | None, adapter: str = ""):
    """The reply of `method` (a unary RPC of the worker service) on a serving worker, routed by `route_ids`.

    A call that fails UNAVAILABLE (the worker died, drains, or its engine core is down) goes again to another
    serving worker (or the same once it serves again), at most `resume.max_resumes` times, waiting at most
    `resume.wait_s` and never past the deadline; the call has no side effects, so trying it twice is harmless.
    Any other status is the request's own and is raised as it came.
    """
    deadline = time.monotonic() + timeout if timeout is not None else None
    failed: dict[str, int] = {}  # address -> its health checks done when it last failed the call
    request_id = request.request_id
    attempt, retries = request, 0
    while True:
        worker = await next_worker(fleet, route_ids, failed, resume.wait_s, deadline, adapter, KINDS[method])
        if retries:  # a worker may still hold the attempt that failed: the next one gets an id of its own
            attempt = type(request)()
            attempt.CopyFrom(request)
            attempt.request_id = f"{request_id}.{retries}"
        left = max(0.0, deadline - time.monotonic()) if deadline is not None else None
        worker.in_flight += 1
        ROUTED.labels(worker.address).inc()
        try:
            return await getattr(worker.stub, method)(attempt, timeout=left)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or retries >= resume.max_resumes:
                raise
            worker.wake()  # it may be gone: out of the rotation now, not at its next check
            failed[worker.address] = worker.checks
            retries += 1
            RETRIED.labels(worker.address).inc()
            log.warning("%s %s: worker %s is unavailable (%s); trying again (%d of at most %d)", method,
                        request_id, worker.address, e.details(), retries, resume.max_resumes)
        finally:
            worker.in_flight -= 1
