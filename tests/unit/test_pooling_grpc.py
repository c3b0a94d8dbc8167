"""The gateway's Embed and Score RPCs on a real grpc.aio server on port 0, over fake downstreams."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from gateway.core.generation import GenerationCore
from gateway.core.scoring import DEFAULT_INSTRUCTION, reranker_prompt
from gateway.grpc_api.servicer import GatewayServicer
from tests.unit.pooling_fakes import assert_rows_close, fake_downstreams, raw_vector, unit
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc


@contextlib.asynccontextmanager
async def gateway_stub(downstreams, max_message_bytes: int = 4 << 20):
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayServicer(GenerationCore(downstreams, {}), "qwen3", max_message_bytes=max_message_bytes), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GatewayServiceStub(channel)
    finally:
        await server.stop(None)


def call(downstreams, method: str, request, **server):
    async def run():
        async with gateway_stub(downstreams, **server) as stub:
            return await getattr(stub, method)(request, timeout=10)
    return asyncio.run(run())


def test_embed_texts_and_ids(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer)
    request = gateway_pb2.EmbedRequest(inputs=[gateway_pb2.EmbedInput(text="hello"),
                                               gateway_pb2.EmbedInput(token_ids=[9, 8, 7])],
                                       dimensions=6, request_id="mine")
    reply = call(downstreams, "Embed", request)
    ids = demo_tokenizer.encode("hello")
    assert_rows_close([e.values for e in reply.embeddings],
                      [unit(raw_vector(ids)[:6]), unit(raw_vector([9, 8, 7])[:6])])
    assert reply.usage.prompt_tokens == len(ids) + 3 and reply.request_id == "mine"


@pytest.mark.parametrize("request_, says", [
    (gateway_pb2.EmbedRequest(), "inputs is empty"),
    (gateway_pb2.EmbedRequest(inputs=[gateway_pb2.EmbedInput()]), "inputs[0] is empty"),
    (gateway_pb2.EmbedRequest(inputs=[gateway_pb2.EmbedInput(text="a")] * 300), "send fewer inputs"),
])
def test_embed_refusals_are_invalid_argument(demo_tokenizer, request_, says):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        call(fake_downstreams(demo_tokenizer), "Embed", request_, max_message_bytes=16 << 10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in refused.value.details()


def test_score_with_the_default_and_a_given_instruction(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer, max_context=256)
    reply = call(downstreams, "Score", gateway_pb2.ScoreRequest(query="q", documents=["a", "b"]))
    assert len(reply.scores) == 2 and all(0 < s < 1 for s in reply.scores)
    call(downstreams, "Score", gateway_pb2.ScoreRequest(query="q", documents=["a"], instruction=""))
    sent = [r.text for r in downstreams.tokenizer.requests]
    assert reranker_prompt("q", "a", DEFAULT_INSTRUCTION) in sent and reranker_prompt("q", "a", "") in sent
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        call(downstreams, "Score", gateway_pb2.ScoreRequest(query="q"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
