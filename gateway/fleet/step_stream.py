"""One request's worker outputs, taken in batches: everything that arrived while the reader was busy, at once."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from rpcserver.errors import Unavailable
from rpcserver.pieces import PromptLogprobsJoiner
from vllm_v0.worker.v1 import worker_pb2

Step = worker_pb2.GenerateResponse


class StepBuffer:
    """Steps added one at a time by whoever reads the worker, taken all at once by the request's reader.

    A reader that falls behind (its client is slow, or tokens come faster than a message per token
    can go out) gets every step it missed in one batch, so it handles them in one pass and sends
    them in one message. At most one waiter is woken per batch, however many steps it holds.
    """

    __slots__ = ("steps", "ended", "error", "waiter", "hold_until", "holding")

    def __init__(self):
        self.steps: list[Step] = []
        self.ended = False
        self.error: BaseException | None = None  # raised once the steps before it are taken
        self.waiter: asyncio.Future | None = None
        self.hold_until: float | None = None  # the next take() waits until then (loop time), unless the end comes
        self.holding = False

    def put(self, step: Step) -> None:
        self.steps.append(step)
        if self.waiter is not None and not self.holding:
            self._wake()

    def end(self, error: BaseException | None = None) -> None:
        """No step follows; `error`, when given, is raised after the steps already added."""
        if not self.ended:
            self.ended, self.error = True, error
        if self.waiter is not None:
            self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Step]:
        """Every step waiting (at least one); [] at the end; the error, if the stream ended with one."""
        hold_until, self.hold_until = self.hold_until, None
        if hold_until is not None and not self.ended:
            await self._hold(hold_until)
        while not self.steps:
            if self.ended:
                if self.error is not None:
                    raise self.error
                return []
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        steps, self.steps = self.steps, []
        return steps

    async def _hold(self, until: float) -> None:
        """Lets steps pile up until `until`; the stream's end (its last token, or an error) ends the wait early."""
        loop = asyncio.get_running_loop()
        if until <= loop.time():
            return
        self.holding = True
        self.waiter = loop.create_future()
        timer = loop.call_at(until, self._wake)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.holding = False
            self.waiter = None


class PieceJoin:
    """Joins the pieces of a long prompt's logprobs, which come before the first token's message, onto it,
    so what follows sees one message per token, as when the prompt was short.

    Pieces come only past a megabyte of entries, whose copy would hold the event loop for tens of
    milliseconds: they are joined on a thread (this stream's later steps wait for it, other streams do not).
    """

    def __init__(self):
        self.joiner = PromptLogprobsJoiner()
        self.done = False  # the first token has come: nothing is left to join

    async def __call__(self, steps: list[Step]) -> list[Step]:
        joined = []
        for step in steps:
            if self.done:
                joined.append(step)
                continue
            try:
                if step.prompt_logprobs_only:
                    self.joiner.add(step)
                    continue
                joiner = self.joiner
                step = await asyncio.to_thread(joiner.complete, step) if joiner.pieces else joiner.complete(step)
            except ValueError as e:
                raise Unavailable(f"the model worker's prompt logprobs do not join up: {e}") from None
            self.done = True
            joined.append(step)
        return joined


class StepStream:
    """A request's steps, in batches (`batches()`) or one at a time (async iteration), with pieces joined."""

    def __init__(self):
        self.buffer = StepBuffer()
        self._join = PieceJoin()

    def __aiter__(self) -> AsyncIterator[Step]:
        return self._each()

    def hold(self, until: float) -> None:
        """The next batch is taken no sooner than `until` (loop time), unless the stream ends first."""
        self.buffer.hold_until = until

    async def _each(self) -> AsyncIterator[Step]:
        async for batch in self.batches():
            for step in batch:
                yield step

    async def batches(self) -> AsyncIterator[list[Step]]:
        while batch := await self.buffer.take():
            if not self._join.done:
                batch = await self._join(batch)
                if not batch:
                    continue
            yield batch


class CallSteps(StepStream):
    """A worker's Generate call read into batches by a task of its own, so the steps that came while the
    request's reader was busy are taken at once; cancel() ends the call."""

    def __init__(self, call):
        super().__init__()
        self.call = call
        self._reader: asyncio.Task | None = None

    def batches(self) -> AsyncIterator[list[Step]]:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        return super().batches()

    async def _read(self) -> None:
        try:
            async for step in self.call:
                self.buffer.put(step)
        except Exception as e:  # noqa: BLE001 - the call's status (or whatever broke) is the request's error
            self.buffer.end(e)
        else:
            self.buffer.end()

    def cancel(self) -> bool:
        if self._reader is not None:
            self._reader.cancel()
        self.buffer.end()
        return self.call.cancel()
