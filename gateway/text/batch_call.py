"""One DecodeBatches call, shared by every text stream: items batched into messages, results matched to them."""
from __future__ import annotations

import asyncio
import collections
import logging

import grpc

from rpcserver.errors import Unavailable
from rpcserver.pieces import GRPC_MESSAGE_BYTES, element_bytes, piece_budget, runs
from rpcserver.status import SharedCallError, status_from_number
from vllm_v0.tokenizer.v1 import tokenizer_pb2

log = logging.getLogger(__name__)

# The most bytes a DecodeBatchItem takes besides its ids (5 bytes each at most): its framing, stream id and flags.
ITEM_BYTES = 32


class BatchCall:
    """One DecodeBatches call: items go out together, one message (several when they pass `budget` bytes)
    for every item added since the last one was written, and results answer the items in order, a result
    cut into parts joined first.

    The writer takes what is waiting each time it is free: items added in one loop iteration go
    together, and while a write is in progress (many streams, a busy loop) the next message gathers
    every item added meanwhile, however many iterations that takes. No item waits for a timer.
    The call has no deadline of its own: each request's deadline bounds its generation upstream.
    """

    def __init__(self, call, loop: asyncio.AbstractEventLoop, budget: int = piece_budget(GRPC_MESSAGE_BYTES)):
        self.call = call
        self.loop = loop
        self.budget = budget  # the most bytes a message sent may take
        self.failure: str | None = None  # why the call is over, once it is
        self.items: list[tokenizer_pb2.DecodeBatchItem] = []  # the next message
        self.bound = 0  # at least the bytes the next message takes
        # (stream id, future) per item of the next message that is not a close; then of each one sent, unanswered.
        self.replies: list[tuple[int, asyncio.Future]] = []
        self.in_flight: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.parts: list[tokenizer_pb2.DecodeBatchResult] = []  # the leading parts of a result cut short
        self.idle: asyncio.Future | None = None  # the writer waits on it while it has nothing to send
        self.tasks = [loop.create_task(self._write()), loop.create_task(self._read())]

    @property
    def pending(self) -> bool:
        """Whether items are waiting to go out."""
        return bool(self.items)

    def submit(self, item: tokenizer_pb2.DecodeBatchItem) -> asyncio.Future | None:
        """Queue an item for the next message; its future gets (text, pieces). A close gets no reply."""
        if self.failure is not None:
            raise Unavailable(self.failure)
        reply = None
        if not item.close:
            reply = self.loop.create_future()
            self.replies.append((item.stream_id, reply))
        self.items.append(item)
        self.bound += ITEM_BYTES + 5 * (len(item.token_ids) + len(item.piece_ids))
        if self.idle is not None and not self.idle.done():
            self.idle.set_result(None)
        return reply

    def _take(self) -> list[tokenizer_pb2.DecodeBatchRequest]:
        """The waiting items as messages within the budget; their replies are in flight from here."""
        items = self.items
        if self.bound <= self.budget:  # the usual message, a few ids per stream: no item's size is needed
            messages = [tokenizer_pb2.DecodeBatchRequest(items=items)]
        else:
            messages = [tokenizer_pb2.DecodeBatchRequest(items=items[run.start:run.stop])
                        for run in runs([element_bytes(item.ByteSize()) for item in items], self.budget)]
        self.in_flight.extend(self.replies)
        self.items, self.replies, self.bound = [], [], 0
        return messages

    async def _write(self) -> None:
        try:
            while True:
                if not self.items:
                    self.idle = self.loop.create_future()
                    await self.idle
                    continue
                for message in self._take():
                    await self.call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The call ended between two messages (the service died or restarted): its status says why.
            await self._fail_with_status()
        except Exception as e:  # noqa: BLE001 - whatever it was, no add may wait forever
            log.exception("DecodeBatches writer failed")
            self.fail(f"the gateway's DecodeBatches call failed ({type(e).__name__}: {e}); retry")

    async def _read(self) -> None:
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    await self._fail_with_status()
                    return
                self._answer(response)
        except grpc.aio.AioRpcError as e:
            self.fail(f"the tokenizer service ended the DecodeBatches call ({e.code().name}: {e.details()}); retry")
        except Exception as e:  # noqa: BLE001
            log.exception("DecodeBatches reader failed")
            self.fail(f"the gateway's DecodeBatches call failed ({type(e).__name__}: {e}); retry")

    def _answer(self, response: tokenizer_pb2.DecodeBatchResponse) -> None:
        # Results, not replies, match items: a request's results may span several replies.
        for result in response.results:
            if not self.in_flight:
                raise RuntimeError("the tokenizer service sent a DecodeBatches result for no item")
            stream_id, reply = self.in_flight[0]
            if result.stream_id != stream_id:
                raise RuntimeError(f"the tokenizer service answered stream {result.stream_id} for {stream_id}")
            if result.more:
                self.parts.append(result)
                continue
            self.in_flight.popleft()
            if reply.done():  # its add was cancelled: the text goes nowhere
                self.parts = []
                continue
            if result.error_code:  # this stream's item was refused; the call and the other streams go on
                reply.set_exception(SharedCallError(status_from_number(result.error_code), result.error_message))
            elif not self.parts:  # the usual result, whole
                reply.set_result((result.text, list(result.pieces)))
            else:
                parts = [*self.parts, result]
                reply.set_result(("".join(part.text for part in parts), [p for part in parts for p in part.pieces]))
            self.parts = []

    async def _fail_with_status(self) -> None:
        code, details = await self.call.code(), await self.call.details()
        self.fail(f"the tokenizer service ended the DecodeBatches call ({code.name}: {details}); retry")

    def fail(self, reason: str) -> None:
        """End the call: every waiting add and every later add on its streams raises Unavailable(reason)."""
        if self.failure is not None:
            return
        self.failure = reason
        waiting = [reply for _, reply in [*self.replies, *self.in_flight]]
        self.items, self.replies, self.parts, self.bound = [], [], [], 0
        self.in_flight.clear()
        for reply in waiting:
            if not reply.done():
                reply.set_exception(Unavailable(reason))
        self.call.cancel()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
