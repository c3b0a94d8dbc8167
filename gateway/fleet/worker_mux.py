"""One GenerateMany call per worker carrying every request this gateway sends it, each looking like a Generate call."""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from gateway.fleet.step_stream import StepStream
from rpcserver.pieces import GRPC_MESSAGE_BYTES, element_bytes
from rpcserver.status import SharedCallError, status_from_number
from vllm_v0.worker.v1 import worker_pb2

log = logging.getLogger(__name__)

# Opens a GenerateMany call that sends what the iterator yields: a worker stub's method, or a fake in tests.
OpenCall = Callable[[AsyncIterator[worker_pb2.GenerateManyRequest]], grpc.aio.StreamStreamCall]


class CallBroken(SharedCallError):
    """A request's end because the shared call itself ended (the worker died or its connection dropped), not
    because the worker failed that request."""


class MuxRequest(StepStream):
    """One request on a shared call: its steps in batches or one by one, and `cancel()`, as a Generate call."""

    def __init__(self, call: MuxCall, wire_id: str, request_id: str):
        super().__init__()
        self.call = call
        self.wire_id = wire_id
        self.request_id = request_id
        self.timer: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        """Drop it on the worker (its blocks are freed within a step); a no-op once it has ended."""
        self.call.cancel(self)


class MuxCall:
    """One GenerateMany call and the requests open on it.

    A reader task hands each output to its request. Wire ids are unique for the call's life, so a
    cancelled request's outputs still in flight never reach a later request of the same caller id.
    When its last request ends the call is half-closed, so the worker ends it: a draining worker
    is not held open, and no idle call lingers. A start larger than `max_message_bytes` never goes
    out: the worker's gRPC would end the whole call for it, so it fails alone, here.
    """

    def __init__(self, open_call: OpenCall, on_closed: Callable[[MuxCall], None], label: str,
                 max_message_bytes: int = GRPC_MESSAGE_BYTES):
        self.label = label  # the worker's address, for logs
        self.max_message_bytes = max_message_bytes  # the worker's receive limit, taken to be the gateway's own
        self._on_closed = on_closed
        self._outgoing: asyncio.Queue = asyncio.Queue()  # messages to send; None half-closes
        self._requests: dict[str, MuxRequest] = {}       # wire id -> request, open ones only
        self._caller_ids: set[str] = set()
        self._ids = itertools.count()
        self.accepting = True
        self._call = open_call(self._send())
        self._reader = asyncio.create_task(self._read(), name=f"GenerateMany {label}")

    def start(self, work: worker_pb2.GenerateRequest, timeout: float | None) -> MuxRequest:
        request_id = work.request_id or uuid.uuid4().hex
        request = MuxRequest(self, f"{request_id}#{next(self._ids)}", request_id)
        if request_id in self._caller_ids:
            # What the worker says of a request id already generating, had it been its own call.
            request.buffer.end(SharedCallError(grpc.StatusCode.INVALID_ARGUMENT, (
                f"request id {request_id!r} is already generating; use a unique id")))
            return request
        start = worker_pb2.GenerateRequest()
        start.CopyFrom(work)
        start.request_id = request.wire_id
        size = element_bytes(start.ByteSize())
        if size > self.max_message_bytes:
            request.buffer.end(SharedCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"the request takes {size} bytes on the way to the model worker, over the {self.max_message_bytes} "
                "bytes a message may take (--max-message-bytes): shorten the prompt or the structured output")))
            self._close_if_idle()
            return request
        self._requests[request.wire_id] = request
        self._caller_ids.add(request_id)
        self._outgoing.put_nowait(worker_pb2.GenerateManyRequest(start=start))
        if timeout is not None:
            request.timer = asyncio.get_running_loop().call_later(timeout, self._expire, request)
        return request

    def cancel(self, request: MuxRequest) -> None:
        if self._end(request):
            self._outgoing.put_nowait(worker_pb2.GenerateManyRequest(cancel=request.wire_id))
            self._close_if_idle()

    def _expire(self, request: MuxRequest) -> None:
        # The deadline a Generate call carried is kept here: the shared call has none of its own.
        if self._end(request):
            self._outgoing.put_nowait(worker_pb2.GenerateManyRequest(cancel=request.wire_id))
            request.buffer.end(SharedCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._close_if_idle()

    def _end(self, request: MuxRequest) -> bool:
        """Forget an open request; False if it had already ended."""
        if self._requests.pop(request.wire_id, None) is None:
            return False
        self._caller_ids.discard(request.request_id)
        if request.timer is not None:
            request.timer.cancel()
        return True

    def _close_if_idle(self) -> None:
        if not self._requests and self.accepting:
            self.accepting = False
            self._on_closed(self)
            self._outgoing.put_nowait(None)

    async def _send(self) -> AsyncIterator[worker_pb2.GenerateManyRequest]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    async def _read(self) -> None:
        try:
            async for response in self._call:
                self._dispatch(response)
            error = SharedCallError(grpc.StatusCode.UNAVAILABLE, "the model worker ended the call early")
        except grpc.aio.AioRpcError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - whatever broke the reader, its requests must not hang
            log.exception("worker %s: reading GenerateMany failed", self.label)
            error = SharedCallError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        if self._requests:
            log.warning("worker %s: GenerateMany ended with %s (%s): failing its %d open requests", self.label,
                        error.code().name, error.details(), len(self._requests))
        self._fail_all(error.code(), error.details() or "")

    def _dispatch(self, response: worker_pb2.GenerateManyResponse) -> None:
        # Once per token of every open request: a lookup and an append, nothing that grows with the request.
        requests = self._requests
        for output in response.outputs:
            request = requests.get(output.request_id)
            if request is None:
                continue  # cancelled or expired here; its cancel is on its way
            if output.error_code:
                self._end(request)
                request.buffer.end(SharedCallError(status_from_number(output.error_code), output.error_message))
                continue
            step = output.step
            request.buffer.put(step)
            if step.finish_reason:
                self._end(request)
                request.buffer.end()
        self._close_if_idle()

    def _fail_all(self, code: grpc.StatusCode, details: str) -> None:
        if self.accepting:
            self.accepting = False
            self._on_closed(self)
            self._outgoing.put_nowait(None)  # ends the sender, should the call still be reading it
        for request in list(self._requests.values()):
            self._end(request)
            request.buffer.end(CallBroken(code, details))


class WorkerMux:
    """A worker's multiplexed calls: the one new requests go on, opened on demand."""

    def __init__(self, open_call: OpenCall, label: str, max_message_bytes: int = GRPC_MESSAGE_BYTES):
        self.open_call = open_call
        self.label = label
        self.max_message_bytes = max_message_bytes
        self.current: MuxCall | None = None

    def open(self, work: worker_pb2.GenerateRequest, timeout: float | None) -> MuxRequest:
        if self.current is None:
            self.current = MuxCall(self.open_call, self._closed, self.label, self.max_message_bytes)
        return self.current.start(work, timeout)

    def _closed(self, call: MuxCall) -> None:
        if self.current is call:
            self.current = None
