"""One generation's text, from the tokenizer service over a single DecodeStream call."""
from __future__ import annotations

import asyncio

import grpc

from rpcserver.errors import Unavailable
from vllm_v0.tokenizer.v1 import tokenizer_pb2


class TextStream:
    """Sends each new id on one open DecodeStream call and reads back its text delta.

    The service keeps the window of ids (a character split across tokens is held back until
    complete), so a token costs one small message each way on a stream that is already open,
    instead of a unary call that re-sends the window. Replies come one per message, in order.
    """

    def __init__(self, tokenizer_stub, skip_special_tokens: bool, timeout: float | None):
        self.call = tokenizer_stub.DecodeStream(timeout=timeout)
        self.skip_special_tokens = skip_special_tokens
        self.first = True

    async def add(self, token_ids: list[int], final: bool = False,
                  piece_ids: list[int] = ()) -> tuple[str, list[bytes]]:
        """(text delta, raw bytes of each id in piece_ids)."""
        request = tokenizer_pb2.DecodeStreamRequest(token_ids=token_ids, final=final, piece_ids=piece_ids)
        if self.first:
            request.skip_special_tokens = self.skip_special_tokens
            self.first = False
        try:
            await self.call.write(request)
            reply = await self.call.read()
        except asyncio.InvalidStateError:
            # The call ended before this write (the service died between two tokens): its status says why.
            raise Unavailable(f"the tokenizer service ended the DecodeStream call ({(await self.call.code()).name}: "
                              f"{await self.call.details()}); retry") from None
        if reply is grpc.aio.EOF:
            raise Unavailable("the tokenizer service ended a DecodeStream call early")
        if final:
            await self.call.done_writing()
            await self.call.code()  # the service ends the call after the final reply: let it end OK
        return reply.text, list(reply.pieces)

    def cancel(self) -> None:
        self.call.cancel()
