"""TokenizerService: requests to TokenizerCore calls and back."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rpcserver.errors import InvalidArgument, ServiceError, Unavailable
from rpcserver.handlers import MalformedRequest
from rpcserver.status import grpc_errors, status_for
from services.tokenizer.core import TokenizerCore
from services.tokenizer.decode_batches import DecodeBatchState, StreamLimits, reply_messages
from services.tokenizer.decode_stream import DecodeStreamState, TokenPieces
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc


T = TypeVar("T")

# Threads that encode, render chat templates and decode long inputs, off the event loop.
DEFAULT_THREADS = 4
# A decode stream message with more ids than this is decoded on a thread. The per-step messages carry
# a few ids each and stay on the loop, where they cost less than the hop to a thread would.
LARGE_DECODE_IDS = 1024


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, core: TokenizerCore | None = None, stream_limits: StreamLimits = StreamLimits(),
                 threads: int = DEFAULT_THREADS):
        # Registered before the server starts; the core arrives once the tokenizer has loaded.
        self._core = core
        self.stream_limits = stream_limits
        self._pieces = TokenPieces(core) if core is not None else None
        # The loop carries every stream's text (DecodeBatches): work that grows with a request's input
        # runs here instead, so one long prompt does not stall every other caller's tokens.
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def off_loop(self, work: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    @property
    def core(self) -> TokenizerCore:
        if self._core is None:
            raise Unavailable("the tokenizer is still loading; retry shortly")
        return self._core

    @core.setter
    def core(self, core: TokenizerCore) -> None:
        self._core = core
        self._pieces = TokenPieces(core)

    @grpc_errors
    async def Encode(self, request: tokenizer_pb2.EncodeRequest, context) -> tokenizer_pb2.EncodeResponse:
        core = self.core
        ids, rendered = await self.off_loop(encode, core, request)
        return tokenizer_pb2.EncodeResponse(token_ids=ids, rendered=rendered)

    @grpc_errors
    async def Decode(self, request: tokenizer_pb2.DecodeRequest, context) -> tokenizer_pb2.DecodeResponse:
        core = self.core
        text = await self.off_loop(lambda: core.decode(list(request.token_ids), request.skip_special_tokens))
        return tokenizer_pb2.DecodeResponse(text=text)

    @grpc_errors
    async def DecodeIncremental(self, request: tokenizer_pb2.DecodeIncrementalRequest, context
                                ) -> tokenizer_pb2.DecodeIncrementalResponse:
        core = self.core
        text, advance, read_offset = await self.off_loop(lambda: core.decode_incremental(
            list(request.token_ids), request.read_offset, request.skip_special_tokens, request.final))
        return tokenizer_pb2.DecodeIncrementalResponse(text=text, prefix_advance=advance, read_offset=read_offset)

    @grpc_errors
    async def DecodeStream(self, requests, context):
        core, state = self.core, None
        async for request in requests:
            if isinstance(request, MalformedRequest):
                raise InvalidArgument(f"a DecodeStream message does not parse: {request.error}")
            if state is None:
                state = DecodeStreamState(core, request.skip_special_tokens)
            if len(request.token_ids) + len(request.piece_ids) > LARGE_DECODE_IDS:
                yield await self.off_loop(self._decode_stream_step, core, state, request)
            else:
                yield self._decode_stream_step(core, state, request)
            if request.final:
                return

    def _decode_stream_step(self, core: TokenizerCore, state: DecodeStreamState,
                            request: tokenizer_pb2.DecodeStreamRequest) -> tokenizer_pb2.DecodeStreamResponse:
        piece_ids = list(request.piece_ids)
        core.check_ids(piece_ids)
        text = state.add(list(request.token_ids), request.final)
        return tokenizer_pb2.DecodeStreamResponse(text=text, pieces=[self._pieces(i) for i in piece_ids])

    @grpc_errors
    async def DecodeBatches(self, requests, context):
        core = self.core
        batch = DecodeBatchState(core, self.stream_limits)
        async for request in requests:
            if isinstance(request, MalformedRequest):
                raise InvalidArgument(f"a DecodeBatches message does not parse: {request.error}")
            # An id takes a byte at least: a message that small cannot hold many (the usual case, counted in C).
            if request.ByteSize() > LARGE_DECODE_IDS and \
                    sum(len(item.token_ids) + len(item.piece_ids) for item in request.items) > LARGE_DECODE_IDS:
                response = await self.off_loop(self._decode_batch_step, core, batch, request)
            else:
                response = self._decode_batch_step(core, batch, request)
            # Cut to stay under the send limit: one oversized reply would end every stream on the call.
            for reply in reply_messages(response.results, self.stream_limits.max_message_bytes):
                yield reply

    def _decode_batch_step(self, core: TokenizerCore, batch: DecodeBatchState,
                           request: tokenizer_pb2.DecodeBatchRequest) -> tokenizer_pb2.DecodeBatchResponse:
        results = []
        now = batch.clock()  # one message's items arrived together
        for item in request.items:
            token_ids, piece_ids = list(item.token_ids), list(item.piece_ids)
            if item.close:
                batch.close(item.stream_id, token_ids, piece_ids)
                continue
            try:
                core.check_ids(piece_ids)
                text = batch.add(item.stream_id, token_ids, item.final, item.skip_special_tokens, now)
            except ServiceError as e:
                # The call carries every generation's text: a bad item ends its own stream only.
                batch.forget(item.stream_id)
                results.append(tokenizer_pb2.DecodeBatchResult(
                    stream_id=item.stream_id, error_code=status_for(e).value[0], error_message=str(e)))
                continue
            result = tokenizer_pb2.DecodeBatchResult(stream_id=item.stream_id, text=text)
            if piece_ids:
                result.pieces.extend([self._pieces(i) for i in piece_ids])
            results.append(result)
        return tokenizer_pb2.DecodeBatchResponse(results=results)

    @grpc_errors
    async def GetInfo(self, request, context) -> tokenizer_pb2.GetInfoResponse:
        info = self.core.info
        return tokenizer_pb2.GetInfoResponse(
            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids, has_chat_template=info.has_chat_template,
            special_tokens=[tokenizer_pb2.SpecialToken(id=i, content=c) for i, c in info.special_tokens],
            embedding_prompts=info.embedding.prompts, default_embedding_prompt_name=info.embedding.default_prompt_name,
            embedding_modules=info.embedding.modules, embedding_pooling_modes=info.embedding.pooling_modes)


def encode(core: TokenizerCore, request: tokenizer_pb2.EncodeRequest) -> tuple[list[int], str]:
    """(ids, rendered) of an EncodeRequest: the messages' conversion, the template's render and the encode."""
    return core.encode_request(
        text=request.text, messages=[chat_message(m) for m in request.messages],
        add_special_tokens=request.add_special_tokens, tools=list(request.tools),
        add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        enable_thinking=request.enable_thinking if request.HasField("enable_thinking") else None)


def chat_message(message: tokenizer_pb2.ChatMessage) -> dict:
    """A message as transformers' templates see it: the OpenAI shape, optional keys only when set."""
    rendered = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered
