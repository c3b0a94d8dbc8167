"""TokenizerService: requests to TokenizerCore calls and back."""
from __future__ import annotations

from rpcserver.errors import Unavailable
from rpcserver.status import grpc_errors
from services.tokenizer.core import TokenizerCore
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, core: TokenizerCore | None = None):
        # Registered before the server starts; the core arrives once the tokenizer has loaded.
        self._core = core

    @property
    def core(self) -> TokenizerCore:
        if self._core is None:
            raise Unavailable("the tokenizer is still loading; retry shortly")
        return self._core

    @core.setter
    def core(self, core: TokenizerCore) -> None:
        self._core = core

    @grpc_errors
    async def Encode(self, request: tokenizer_pb2.EncodeRequest, context) -> tokenizer_pb2.EncodeResponse:
        ids, rendered = self.core.encode_request(
            text=request.text, messages=[{"role": m.role, "content": m.content} for m in request.messages],
            add_special_tokens=request.add_special_tokens,
            add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
            enable_thinking=request.enable_thinking if request.HasField("enable_thinking") else None)
        return tokenizer_pb2.EncodeResponse(token_ids=ids, rendered=rendered)

    @grpc_errors
    async def Decode(self, request: tokenizer_pb2.DecodeRequest, context) -> tokenizer_pb2.DecodeResponse:
        return tokenizer_pb2.DecodeResponse(text=self.core.decode(list(request.token_ids), request.skip_special_tokens))

    @grpc_errors
    async def DecodeIncremental(self, request: tokenizer_pb2.DecodeIncrementalRequest, context
                                ) -> tokenizer_pb2.DecodeIncrementalResponse:
        text, advance, read_offset = self.core.decode_incremental(
            list(request.token_ids), request.read_offset, request.skip_special_tokens, request.final)
        return tokenizer_pb2.DecodeIncrementalResponse(text=text, prefix_advance=advance, read_offset=read_offset)

    @grpc_errors
    async def GetInfo(self, request, context) -> tokenizer_pb2.GetInfoResponse:
        info = self.core.info
        return tokenizer_pb2.GetInfoResponse(
            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids, has_chat_template=info.has_chat_template,
            special_tokens=[tokenizer_pb2.SpecialToken(id=i, content=c) for i, c in info.special_tokens])
