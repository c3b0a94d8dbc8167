"""GenerateMany's core: many requests on one call, each engine step's outputs for all of them in one message."""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from rpcserver.errors import InvalidArgument, ServiceError
from rpcserver.handlers import MalformedRequest
from rpcserver.pieces import GRPC_MESSAGE_BYTES, element_bytes, piece_budget, runs, split_prompt_logprobs
from rpcserver.status import status_for
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core.client import EngineClient
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.sequence import FinishReason
from services.model_worker.server.metrics import REQUESTS
from vllm_v0.worker.v1 import worker_pb2

log = logging.getLogger(__name__)

FINISH_REASONS = {None: worker_pb2.FINISH_REASON_UNSPECIFIED, FinishReason.EOS: worker_pb2.FINISH_REASON_EOS,
                  FinishReason.LENGTH: worker_pb2.FINISH_REASON_LENGTH}

# Prompt logprobs for more positions than this are built on BUILDER, not on the event loop: at 20
# candidates a position, a 3,500-token prompt is 73,500 messages, about 20 ms of CPU (more with the
# collector), while every other stream of the server waits. Below it, a build takes about a millisecond.
OFF_LOOP_POSITIONS = 256
# One thread: large builds queue behind each other, and the loop contends with one thread for the GIL,
# which it gets back every switch interval (5 ms), however many builds are waiting.
BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-messages")


def builds_off_loop(out: StepOutput) -> bool:
    return out.prompt_logprobs is not None and len(out.prompt_logprobs) > OFF_LOOP_POSITIONS


async def built_step_messages(out: StepOutput, first: bool, budget: int) -> list[worker_pb2.GenerateResponse]:
    """`step_messages`, built on BUILDER when the output carries many prompt logprobs."""
    if builds_off_loop(out):
        return await asyncio.get_running_loop().run_in_executor(BUILDER, step_messages, out, first, budget)
    return step_messages(out, first, budget)


def step_messages(out: StepOutput, first: bool, budget: int) -> list[worker_pb2.GenerateResponse]:
    """One step of one request as Generate streams it: prompt logprobs too large for `budget` go
    first in pieces of their own (worker.proto's GenerateResponse.prompt_logprobs), then the token's message."""
    return split_prompt_logprobs(step_message(out, first), budget,
                                 lambda: worker_pb2.GenerateResponse(prompt_logprobs_only=True))


def step_message(out: StepOutput, first: bool) -> worker_pb2.GenerateResponse:
    """One step of one request as Generate streams it, whole; the prompt length rides on the first."""
    msg = worker_pb2.GenerateResponse(token_id=out.token_id, finish_reason=FINISH_REASONS[out.finish_reason],
                                      prompt_tokens=out.prompt_tokens if first else 0)
    if out.spec_accepted is not None:
        msg.spec_accepted = out.spec_accepted
    if out.logprob is not None:
        msg.logprob = out.logprob
        msg.top_logprobs.extend(worker_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in out.top_logprobs)
    add_entry = msg.prompt_logprobs.add
    for scored in out.prompt_logprobs or ():
        entry = add_entry()
        if scored is not None:
            entry.logprob = scored[0]
            # add() builds each element in place: half the cost of building them apart and copying them in.
            add_top = entry.top.add
            for token_id, logprob in scored[1]:
                add_top(token_id=token_id, logprob=logprob)
    return msg


def request_outputs(request_id: str, out: StepOutput, first: bool,
                    budget: int) -> tuple[list[worker_pb2.RequestOutput], list[int]]:
    """One step of one request as GenerateMany outputs, with each one's bytes in a GenerateManyResponse."""
    outputs = [worker_pb2.RequestOutput(request_id=request_id, step=step) for step in step_messages(out, first, budget)]
    return outputs, [element_bytes(output.ByteSize()) for output in outputs]


class _RequestSink:
    """The engine client's sink for one request of a call: hands each output to the call, naming the request."""

    __slots__ = ("call", "request_id", "first", "waiting")

    def __init__(self, call: MultiplexedCall, request_id: str):
        self.call = call
        self.request_id = request_id
        self.first = True
        # While an output of this request is built off the loop: the ones that came after it, in order.
        self.waiting: collections.deque | None = None

    def put_nowait(self, item: StepOutput | BaseException) -> None:
        self.call._collect(self, item)


class MultiplexedCall:
    """One GenerateMany call: starts and cancels its requests, and sends their outputs a batch per message.

    The engine client hands a step's outputs to the requests' sinks one after another, all within
    the dispatch of that step's frame; each lands in this call's pending list and sets one event.
    The single writer wakes once, after the whole step, and sends everything pending as one
    message: one wake-up and one message per step, however many requests the call carries.

    gRPC ends the whole call when one message passes the send limit, so no message may: pending
    outputs go out in messages of at most the piece budget, a request's large prompt logprobs in
    pieces, and an output that would still pass `max_message_bytes` fails its own request instead.

    An output with many prompt logprobs is built on BUILDER: the loop, and the other requests' outputs,
    go on meanwhile, while that request's later outputs wait for it, so they never overtake it.
    """

    def __init__(self, engine: Callable[[], EngineClient],
                 make_params: Callable[[worker_pb2.GenerateRequest], SamplingParams],
                 max_message_bytes: int = GRPC_MESSAGE_BYTES):
        self._engine = engine  # raises Unavailable while the model loads
        self._make_params = make_params
        self._max_message_bytes = max_message_bytes  # the server's send limit
        self._budget = piece_budget(max_message_bytes)
        self._client: EngineClient | None = None  # the engine the open requests went to
        self._open: dict[str, tuple[str, _RequestSink]] = {}  # request id -> (engine's id, sink)
        self._pending: list[worker_pb2.RequestOutput] = []
        self._pending_sizes: list[int] = []  # each pending output's bytes in a GenerateManyResponse
        self._ready = asyncio.Event()

    @property
    def open_requests(self) -> int:
        return len(self._open)

    async def serve(self, requests: AsyncIterable) -> AsyncIterator[worker_pb2.GenerateManyResponse]:
        """The call's responses, while its requests are read beside them.

        Ends once the caller has half-closed and every request has ended; leaving early (the
        caller cancelled or went away) drops the requests still open.
        """
        reader = asyncio.create_task(self._read(requests), name="GenerateMany reader")
        reader.add_done_callback(lambda _: self._ready.set())
        try:
            while True:
                if self._pending:
                    batch, sizes = self._pending, self._pending_sizes
                    self._pending, self._pending_sizes = [], []
                    for run in runs(sizes, self._budget):
                        yield worker_pb2.GenerateManyResponse(outputs=batch[run.start:run.stop])
                    continue
                if reader.done():
                    reader.result()  # an unreadable message ends the call with its status
                    if not self._open:
                        return
                self._ready.clear()
                await self._ready.wait()
        finally:
            reader.cancel()
            self.close()

    def start(self, request: worker_pb2.GenerateRequest) -> None:
        REQUESTS.labels("GenerateMany").inc()
        request_id = request.request_id
        try:
            if not request_id:
                raise InvalidArgument("request_id is required on GenerateMany: outputs and cancels name it")
            if request_id in self._open:
                raise InvalidArgument(f"request id {request_id!r} is already open on this call; use a unique id")
            client = self._engine()
            sink = _RequestSink(self, request_id)
            engine_id = client.submit(request_id, list(request.prompt_token_ids), self._make_params(request), sink,
                                      output_ids=list(request.output_token_ids), adapter=request.adapter)
        except ServiceError as e:
            self._fail(request_id, status_for(e), str(e))
            return
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the call's others
            log.exception("request %s: internal error", request_id)
            self._fail(request_id, grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
            return
        self._client = client
        self._open[request_id] = (engine_id, sink)

    def cancel(self, request_id: str) -> None:
        """Drop an open request; an unknown or finished one is ignored (its end may be on its way)."""
        entry = self._open.pop(request_id, None)
        if entry is not None and self._client is not None:
            self._client.abort(entry[0])

    def close(self) -> None:
        """Drop every open request: their blocks are freed at the engine's next step boundary."""
        for request_id in list(self._open):
            self.cancel(request_id)

    async def _read(self, requests: AsyncIterable) -> None:
        async for message in requests:
            if isinstance(message, MalformedRequest):
                # No request id can be read from it, so no single request can be failed.
                raise InvalidArgument(f"a message is not a valid {message.type_name} ({message.error}); "
                                      "string fields must be valid UTF-8")
            action = message.WhichOneof("action")
            if action == "start":
                self.start(message.start)
            elif action == "cancel":
                self.cancel(message.cancel)
            # No action: one this worker does not know (a newer caller's); nothing to do.

    def _is_open(self, sink: _RequestSink) -> bool:
        entry = self._open.get(sink.request_id)
        return entry is not None and entry[1] is sink  # else cancelled: the engine may have had outputs in flight

    def _collect(self, sink: _RequestSink, item: StepOutput | BaseException) -> None:
        if not self._is_open(sink):
            return
        if sink.waiting is not None:
            sink.waiting.append(item)  # behind an output of its request still being built
            return
        request_id = sink.request_id
        if isinstance(item, BaseException):
            del self._open[request_id]
            code = status_for(item) if isinstance(item, ServiceError) else grpc.StatusCode.INTERNAL
            self._fail(request_id, code, str(item))
            return
        first, sink.first = sink.first, False
        if builds_off_loop(item):
            sink.waiting = collections.deque()
            build = asyncio.get_running_loop().run_in_executor(BUILDER, request_outputs, request_id, item, first,
                                                                self._budget)
            build.add_done_callback(lambda done: self._built(sink, item, done))
            return
        self._add(sink, item, *request_outputs(request_id, item, first, self._budget))

    def _built(self, sink: _RequestSink, item: StepOutput, build: asyncio.Future) -> None:
        waiting, sink.waiting = sink.waiting, None
        if not self._is_open(sink):
            return  # cancelled while it was built: what waited behind it goes too
        error = build.exception()
        if error is not None:
            log.error("request %s: building its output failed", sink.request_id, exc_info=error)
            self.cancel(sink.request_id)
            self._fail(sink.request_id, grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
            return
        self._add(sink, item, *build.result())
        while waiting:
            self._collect(sink, waiting.popleft())  # in order; one that starts another build queues the rest again

    def _add(self, sink: _RequestSink, item: StepOutput, outputs: list[worker_pb2.RequestOutput],
             sizes: list[int]) -> None:
        request_id = sink.request_id
        if max(sizes) > self._max_message_bytes:
            # Sent, it would end the call and every request on it: this request alone fails.
            self.cancel(request_id)
            self._fail(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"an output of {max(sizes)} bytes is over the worker's message limit of {self._max_message_bytes} "
                "bytes (--max-message-bytes); ask for fewer logprobs or raise the limit"))
            return
        self._pending.extend(outputs)
        self._pending_sizes.extend(sizes)
        if item.finish_reason is not None:
            del self._open[request_id]
        self._ready.set()

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        output = worker_pb2.RequestOutput(request_id=request_id, error_code=code.value[0], error_message=message)
        self._pending.append(output)
        self._pending_sizes.append(element_bytes(output.ByteSize()))
        self._ready.set()
