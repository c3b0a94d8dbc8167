"""TokenizerService.DecodeStream in-process on a real grpc.aio server: text as a full decode, raw bytes, errors."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from demo.vocab import load_ranks, ranks_path
from rpcserver.handlers import add_servicer
from services.tokenizer.servicer import TokenizerServicer
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

TEXT = "Party 🦜🤗 中文分词 <|im_end|> done"


async def with_server(core, body, **servicer_options):
    server = grpc.aio.server()
    add_servicer(server, tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"],
                 TokenizerServicer(core, **servicer_options))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await body(tokenizer_pb2_grpc.TokenizerServiceStub(channel))
    finally:
        await server.stop(None)


async def status_after(call, request) -> tuple[grpc.StatusCode, str]:
    """Write one message on a bidirectional call and read: the status the call ends with."""
    await call.write(request)
    try:
        await call.read()
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return await call.code(), await call.details()


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_one_id_per_message_adds_up_to_the_full_decode(demo_tokenizer, skip_special_tokens):
    ids = demo_tokenizer.encode(TEXT)

    async def body(stub):
        call, texts = stub.DecodeStream(), []
        for i, token_id in enumerate(ids):
            await call.write(tokenizer_pb2.DecodeStreamRequest(
                token_ids=[token_id], skip_special_tokens=skip_special_tokens, final=i == len(ids) - 1))
            texts.append((await call.read()).text)
        await call.done_writing()
        return texts, await call.code()

    texts, code = asyncio.run(with_server(demo_tokenizer, body))
    assert code == grpc.StatusCode.OK
    assert "".join(texts) == demo_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "" in texts and not any("\ufffd" in t for t in texts)  # split characters were held back


def test_pieces_are_the_tokens_bytes(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXT)
    id_bytes = {rank: token for token, rank in load_ranks(ranks_path()).items()}  # rank = id in Qwen's vocabulary
    im_end = demo_tokenizer.tokenizer.token_to_id("<|im_end|>")

    async def body(stub):
        call = stub.DecodeStream()
        await call.write(tokenizer_pb2.DecodeStreamRequest(token_ids=ids, piece_ids=ids, final=True))
        return await call.read()

    reply = asyncio.run(with_server(demo_tokenizer, body))
    assert reply.text == demo_tokenizer.decode(ids)
    assert b"".join(reply.pieces) == TEXT.encode()
    assert [p for p, i in zip(reply.pieces, ids) if i != im_end] == [id_bytes[i] for i in ids if i != im_end]


@pytest.mark.parametrize("field", ["token_ids", "piece_ids"])
def test_ids_outside_the_vocabulary_are_invalid_argument(demo_tokenizer, field):
    async def body(stub):
        return await status_after(stub.DecodeStream(), tokenizer_pb2.DecodeStreamRequest(**{field: [10**9]}))

    code, details = asyncio.run(with_server(demo_tokenizer, body))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in details

