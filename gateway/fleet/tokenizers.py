"""The tokenizer services behind the gateway: one channel each, their health, and a serving one for each call."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import grpc

from gateway.fleet.fleet_metrics import RESUMED
from gateway.fleet.members import Member, MemberSet
from gateway.fleet.worker_stream import ResumePolicy
from rpcserver.errors import Unavailable
from vllm_v0.tokenizer.v1 import tokenizer_pb2_grpc

log = logging.getLogger(__name__)

# Seconds a tokenizer no longer named by DNS keeps its channel, so calls already on it can end.
RETIRE_GRACE_S = 10.0


class Tokenizer(Member):
    """One tokenizer service: its channel and stub, and its health, checked every interval or at once on demand."""

    kind = "tokenizer"
    log = log

    def __init__(self, address: str, channel: grpc.aio.Channel, interval: float,
                 on_change: Callable[[], None] = lambda: None):
        super().__init__(address, channel, interval, on_change)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

    async def check_now(self) -> bool:
        """Check its health at once (a call to it failed) rather than at the next interval; whether it serves."""
        self._set_state(await self._check())
        return self.serving


class TokenizerPool(MemberSet[Tokenizer]):
    """Every tokenizer the --tokenizer-addr targets stand for, kept in step with DNS, behind the stub's surface.

    Encode, Decode and GetInfo go to the serving tokenizers in turn; one that fails UNAVAILABLE is checked at
    once and the call retried on another serving one (or the same once it serves again), at most
    `resume.max_resumes` times, waiting at most `resume.wait_s` (and never past the call's timeout) for one to
    serve. Any other status is the request's own and is passed on. DecodeBatches opens on a serving one.
    """

    kind = "tokenizer"
    log = log

    def __init__(self, targets: list[str], open_channel: Callable[[str], grpc.aio.Channel], interval: float,
                 resume: ResumePolicy = ResumePolicy()):
        super().__init__(targets, open_channel, interval)
        self.resume = resume
        self.tokenizers: dict[str, Tokenizer] = {}
        self._turn = itertools.count()
        self._decoding: Tokenizer | None = None  # where the last DecodeBatches call was opened

    @property
    def members(self) -> dict[str, Tokenizer]:
        return self.tokenizers

    def pick(self, avoid: Tokenizer | None = None) -> Tokenizer | None:
        """A serving tokenizer, each in turn; `avoid` (one a call just failed on) only while no other serves."""
        serving = self.serving()
        others = [t for t in serving if t is not avoid] or serving
        return others[next(self._turn) % len(others)] if others else None

    async def wait_serving(self, wait_s: float, avoid: Tokenizer | None = None) -> Tokenizer | None:
        """A serving tokenizer, waiting up to `wait_s` for one; None if none serves by then."""
        deadline = time.monotonic() + wait_s
        while (tokenizer := self.pick(avoid)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass
        return tokenizer

    async def Encode(self, request, timeout: float | None = None):
        return await self._unary("Encode", request, timeout)

    async def Decode(self, request, timeout: float | None = None):
        return await self._unary("Decode", request, timeout)

    async def GetInfo(self, request, timeout: float | None = None):
        return await self._unary("GetInfo", request, timeout)

    def DecodeBatches(self, timeout: float | None = None):
        """A DecodeBatches call on a serving tokenizer (on any while none is known to serve: health may lag)."""
        tokenizer = self.pick() or self._any()
        self._decoding = tokenizer
        return tokenizer.stub.DecodeBatches(timeout=timeout)

    async def open_decode_batches(self, wait_s: float) -> tuple[grpc.aio.StreamStreamCall, str]:
        """(a new DecodeBatches call, its tokenizer's address) once the last call broke: the tokenizer that call
        was on is checked at once, then a serving one waited for up to `wait_s`; Unavailable if none serves."""
        broken = self._decoding
        if broken is not None and broken.address in self.tokenizers:
            await broken.check_now()
        tokenizer = await self.wait_serving(wait_s, avoid=broken)
        if tokenizer is None:
            raise Unavailable(f"no tokenizer service is serving (waited {wait_s:g} s for one of "
                              f"{', '.join(self.targets)}); retry shortly")
        self._decoding = tokenizer
        return tokenizer.stub.DecodeBatches(), tokenizer.address

    def _any(self) -> Tokenizer:
        if not self.tokenizers:
            raise Unavailable(f"no tokenizer service: {', '.join(self.targets)} names none yet; retry shortly")
        return next(iter(self.tokenizers.values()))

    async def _unary(self, method: str, request, timeout: float | None):
        deadline = time.monotonic() + timeout if timeout is not None else None
        # The first try goes even to one not known to serve: its health may lag, and a dead one fails fast.
        tokenizer = self.pick() or (next(iter(self.tokenizers.values()), None))
        retries, failure = 0, "none is known yet"
        while True:
            if tokenizer is not None:
                left = max(0.0, deadline - time.monotonic()) if deadline is not None else None
                try:
                    return await getattr(tokenizer.stub, method)(request, timeout=left)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or retries >= self.resume.max_resumes:
                        raise
                    failure = f"{tokenizer.address} failed: {e.details()}"
                await tokenizer.check_now()  # out of the rotation now if it is gone, not at its next check
            wait = self.resume.wait_s
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            failed, tokenizer = tokenizer, await self.wait_serving(wait, avoid=tokenizer)
            if tokenizer is None:  # failed as the stub's call would have, for callers of a stub
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details=f"no tokenizer service is serving ({failure}; waited "
                                                   f"{max(wait, 0):g} s for one); retry shortly")
            if failed is not None:
                retries += 1
                if method == "Encode":
                    RESUMED.labels("encode").inc()
                log.warning("%s: tokenizer %s is unavailable; retrying on %s", method, failed.address,
                            tokenizer.address)

    def _join(self, address: str) -> Tokenizer:
        return Tokenizer(address, self.open_channel(address), self.interval, self._changed)

    async def _wait_to_retire(self, tokenizer: Tokenizer) -> None:
        """Calls already on a removed tokenizer have a while to end."""
        await asyncio.sleep(RETIRE_GRACE_S)
