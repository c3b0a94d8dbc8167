"""Every generation's text, from the tokenizer service over one shared DecodeBatches call."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

import grpc

from gateway.text.batch_call import BatchCall
from gateway.text.stream_history import StreamHistory
from rpcserver.errors import Unavailable
from rpcserver.pieces import GRPC_MESSAGE_BYTES, PIECE_HEADROOM, piece_budget
from vllm_v0.tokenizer.v1 import tokenizer_pb2

log = logging.getLogger(__name__)


# Opens a DecodeBatches call once one serves, waiting at most the seconds given: (the call, where it goes).
Reopen = Callable[[float], Awaitable[tuple[object, str]]]


class Detokenizer:
    """Opens a TextStream per request; all of them share one lazily opened DecodeBatches call.

    gRPC costs a fixed amount of CPU per message on each side, so the streams' new ids travel
    together: one message, each time the call's writer is free, for every stream that added ids since.

    One message over the tokenizer's limit would end the call and every stream's text with it, so
    none goes out larger than the piece budget of `max_message_bytes` (the gateway's own limit,
    which the tokenizer is expected to share): a long prompt's ids and logprob pieces are spread
    over several items and messages, and its replies come back in parts, joined here.

    A call that breaks (the tokenizer died or restarted) is replaced by one new call, which `reopen` opens on a
    serving tokenizer; each stream of the old call goes on over it, re-primed with the ids it had sent (see
    StreamHistory), at most `resume.max_resumes` times. Without `resume` a broken call ends its streams.
    """

    def __init__(self, tokenizer_stub, max_message_bytes: int = GRPC_MESSAGE_BYTES, resume=None,
                 reopen: Reopen | None = None, on_reprime: Callable[[], None] = lambda: None):
        self.stub = tokenizer_stub
        self.budget = piece_budget(max_message_bytes)
        self.resume = resume  # a ResumePolicy: its max_resumes and wait_s
        self.reopen_call = reopen or self._reopen_same_stub
        self.on_reprime = on_reprime  # called for each stream primed on a new call
        self.batch: BatchCall | None = None
        self.stream_ids = itertools.count(1)
        self.closed = False
        self._reopening: asyncio.Task | None = None

    def open(self, skip_special_tokens: bool) -> TextStream:
        """A stream for one generation; call from the event loop that will use it.

        While the call is broken a stream starts on it, and its first add moves it onto the new one."""
        loop = asyncio.get_running_loop()
        if self.batch is None or self.batch.loop is not loop or (self.batch.failure is not None and not self.resume):
            self.batch = BatchCall(self.stub.DecodeBatches(), loop, self.budget)
        return TextStream(self, self.batch, next(self.stream_ids), skip_special_tokens)

    async def reopen(self) -> BatchCall:
        """The live call, or a new one for every stream of the broken one: opened once, however many wait."""
        loop = asyncio.get_running_loop()
        if self.batch is not None and self.batch.failure is None and self.batch.loop is loop:
            return self.batch
        task = self._reopening
        if task is None or task.done() or task.get_loop() is not loop:
            reason = self.batch.failure if self.batch is not None else "none was open"
            task = self._reopening = loop.create_task(self._open_again(reason))
            task.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, even if none waits
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this add itself was cancelled
                raise
            raise Unavailable("the gateway is shutting down") from None  # close() ended the wait

    async def _open_again(self, reason: str) -> BatchCall:
        call, address = await self.reopen_call(self.resume.wait_s if self.resume else 0.0)
        if self.closed:
            call.cancel()
            raise Unavailable("the gateway is shutting down")
        self.batch = BatchCall(call, asyncio.get_running_loop(), self.budget)
        log.warning("DecodeBatches: a new call on tokenizer %s carries the text streams on (%s)", address, reason)
        return self.batch

    async def _reopen_same_stub(self, wait_s: float):
        return self.stub.DecodeBatches(), "the tokenizer service"

    async def close(self) -> None:
        self.closed = True
        if self._reopening is not None:
            self._reopening.cancel()
        batch, self.batch = self.batch, None
        if batch is not None:
            batch.fail("the gateway is shutting down")
            if batch.loop is asyncio.get_running_loop():
                await asyncio.gather(*batch.tasks, return_exceptions=True)


class TextStream:
    """One generation's text: `add` sends new ids and returns their text, as DecodeStream did per call."""

    def __init__(self, detokenizer: Detokenizer, batch: BatchCall, stream_id: int, skip_special_tokens: bool):
        self.detokenizer = detokenizer
        self.batch = batch  # the call its state is on
        self.stream_id = stream_id
        self.skip_special_tokens = skip_special_tokens
        self.opened = False  # an item of this stream has gone out on `batch`: the service may hold its state
        self.finished = False  # its final item has gone out: the service forgets it by itself
        self.refused = False  # the service refused an item of it: that error is the request's own
        self.resumes = 0  # times it went on over a new call
        self.history = StreamHistory()

    async def add(self, token_ids: list[int], final: bool = False,
                  piece_ids: list[int] = ()) -> tuple[str, list[bytes]]:
        """(text delta, raw bytes of each id in piece_ids)."""
        if len(token_ids) + len(piece_ids) <= self._per_item():
            items = [self._item(token_ids=token_ids, piece_ids=piece_ids)]
        else:
            # Each within the budget: the piece ids' runs, then the token ids' (the service decodes a
            # stream's items in order, so their texts join).
            items = self._runs("piece_ids", piece_ids) + self._runs("token_ids", token_ids)
        parts = await self._submit(items, final)
        if len(parts) == 1:
            return parts[0]
        return "".join(text for text, _ in parts), [piece for _, pieces in parts for piece in pieces]

    async def add_each(self, token_ids: list[int], final: bool = False,
                       piece_ids: list[int] = ()) -> tuple[list[str], list[bytes]]:
        """(each id's text delta, raw bytes of each id in piece_ids): an item per id, in one message."""
        items = self._runs("piece_ids", piece_ids)
        leading = len(items)
        items += [self._item(token_ids=(token_id,)) for token_id in token_ids]
        parts = await self._submit(items, final)
        return [text for text, _ in parts[leading:]], [piece for _, pieces in parts[:leading] for piece in pieces]

    def _per_item(self) -> int:
        return max(1, (self.batch.budget - PIECE_HEADROOM) // 5)  # 5: the most bytes a uint32 id takes

    def _item(self, **fields) -> tokenizer_pb2.DecodeBatchItem:
        return tokenizer_pb2.DecodeBatchItem(stream_id=self.stream_id, **fields)

    def _runs(self, name: str, ids: list[int]) -> list[tokenizer_pb2.DecodeBatchItem]:
        per_item = self._per_item()
        return [self._item(**{name: ids[i:i + per_item]}) for i in range(0, len(ids), per_item)]

    async def _submit(self, items: list[tokenizer_pb2.DecodeBatchItem], final: bool) -> list[tuple[str, list[bytes]]]:
        """Each item's (text, pieces), the text as delivered; `final` goes on the last item, the stream's
        skip_special_tokens on the first on each call. A call that breaks meanwhile is replaced, and the items
        go again over the new one after the stream's prime."""
        items[-1].final = final
        while True:
            batch = self.batch
            if batch.failure is not None:
                await self._move(batch)
                continue
            prime = [self._item(token_ids=ids) for ids in self.history.prime(self._per_item())] \
                if not self.opened and self.history.ids else []
            out = [*prime, *items]
            if not self.opened:
                out[0].skip_special_tokens = self.skip_special_tokens
            replies = [batch.submit(item) for item in out]
            self.opened = True
            self.finished = final
            try:
                parts = await _answers(replies)
            except Unavailable:
                if batch.failure is None:
                    raise
                continue  # the call broke: the next turn moves the stream
            except grpc.aio.AioRpcError:
                self.refused = True  # the service refused an item: this request's error, never resumed
                raise
            if prime:
                self.history.primed([text for text, _ in parts[:len(prime)]])
                self.detokenizer.on_reprime()
                parts = parts[len(prime):]
            if not final:  # a finished stream is never primed again
                self.history.decoded([item.token_ids for item in items], [text for text, _ in parts])
            texts = self.history.deliver([text for text, _ in parts])
            if final:
                self.history.clear()
            return [(text, pieces) for text, (_, pieces) in zip(texts, parts)]

    async def _move(self, broken: BatchCall) -> None:
        """Carry the stream onto the live call after `broken` ended; Unavailable past the policy's bounds."""
        detokenizer = self.detokenizer
        if detokenizer.closed:
            raise Unavailable(broken.failure)
        if self.opened or self.history.ids:  # a stream that sent nothing there moves freely
            resume = detokenizer.resume
            if self.refused or resume is None or self.resumes >= resume.max_resumes:
                raise Unavailable(broken.failure)
            self.resumes += 1
        self.batch = await detokenizer.reopen()
        self.opened = self.finished = False

    def cancel(self) -> None:
        """Let the service forget an unfinished stream; a no-op once it is finished or its call is gone."""
        if self.opened and not self.finished and self.batch.failure is None:
            self.batch.submit(tokenizer_pb2.DecodeBatchItem(stream_id=self.stream_id, close=True))
        self.finished = True
        self.history.clear()


async def _answers(replies: list[asyncio.Future]) -> list[tuple[str, list[bytes]]]:
    """Each reply's (text, pieces); the first failure raised once every reply is in, so none is left unread."""
    if len(replies) == 1:
        return [await replies[0]]
    parts = await asyncio.gather(*replies, return_exceptions=True)
    for part in parts:
        if isinstance(part, BaseException):
            raise part
    return parts
