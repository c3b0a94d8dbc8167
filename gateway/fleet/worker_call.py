"""One unary call on a worker the router picks (Embed, Score), tried again on another when that one is unavailable."""
from __future__ import annotations

import logging
import time

import grpc

from gateway.fleet.fleet_metrics import RETRIED, ROUTED
from gateway.fleet.worker_stream import ResumePolicy
from gateway.fleet.workers import RECHECK_S, Fleet, Worker
from rpcserver.errors import FailedPrecondition, Unavailable

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
        worker = await _next_worker(fleet, resume, route_ids, failed, deadline, adapter, KINDS[method])
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


async def _next_worker(fleet: Fleet, resume: ResumePolicy, route_ids: list[int], failed: dict[str, int],
                       deadline: float | None, adapter: str, kind: str) -> Worker:
    """A serving worker, leaving out those that failed the call until a health check has seen them since; after
    a failure, waits for one to serve, within the resume wait and the deadline."""
    give_up = time.monotonic() + resume.wait_s
    if deadline is not None:
        give_up = min(give_up, deadline)
    while True:
        exclude = tuple(address for address, checks in failed.items()
                        if (w := fleet.workers.get(address)) is None or w.checks <= checks)
        worker = fleet.pick(route_ids, exclude=exclude, adapter=adapter, kind=kind)
        if worker is not None:
            return worker
        if (why := fleet.unserved(kind)) is not None:
            raise FailedPrecondition(why)
        if not failed:
            if adapter and fleet.serving():
                raise Unavailable(f"no serving model worker has the LoRA adapter {adapter!r} loaded now; "
                                  "retry shortly")
            raise Unavailable("no model worker is serving; retry shortly")
        left = give_up - time.monotonic()
        if left <= 0:
            raise Unavailable(f"no model worker could take the request after its worker failed (waited "
                              f"{resume.wait_s:g} s, within the request's deadline); retry shortly")
        await fleet.wait_for_change(min(left, RECHECK_S))
