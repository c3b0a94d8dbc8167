"""Choosing and listing LoRA adapters at the gateway: gRPC's `adapter` and HTTP's `model` reach the worker
request, an unknown one is refused, and /v1/models and GetInfo list what the serving workers report."""
from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.core.validation import GenerationRequest
from gateway.fleet.adapters import Adapters
from gateway.grpc_api.convert import from_proto
from gateway.grpc_api.servicer import GatewayServicer
from gateway.http_api.http_app import create_app
from rpcserver.errors import InvalidArgument
from tests.unit.test_adapter_routing import fleet_of
from tests.unit.test_generation_core import TEXT, FakeDownstreams, run
from tests.unit.test_http_app import error_of
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

BASE = "fake-model"
PROMPT = {"prompt": "hi", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Downstreams(FakeDownstreams):
    """Fake downstreams in front of a fleet whose serving workers have `sql` (two of them) and `chat` loaded."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, tokenizer.encode(TEXT))
        self.fleet = fleet_of({"a:1": ("sql", "chat"), "b:2": ("sql",)})

    def worker_statuses(self):
        return []


@pytest.fixture()
def served(demo_tokenizer):
    downstreams = Downstreams(demo_tokenizer)
    core = GenerationCore(downstreams, {}, adapters=Adapters(downstreams.fleet))
    return core, downstreams


@pytest.fixture()
def http(served):
    core, downstreams = served
    return TestClient(create_app(core, lambda: BASE, lambda: True, None, 1 << 20)), downstreams


def test_grpc_adapter_reaches_the_worker_request(served):
    core, downstreams = served
    req = from_proto(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=2, adapter="sql"))
    assert req.adapter == "sql"
    run(core, req)
    assert downstreams.works[-1].adapter == "sql"
    run(core, from_proto(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=2)))
    assert downstreams.works[-1].adapter == ""  # the base model


def test_an_unknown_adapter_is_invalid_argument_naming_those_served(served):
    core, downstreams = served
    with pytest.raises(InvalidArgument, match="'nope' is not a LoRA adapter the model workers serve; they serve "
                                              "chat, sql"):
        run(core, GenerationRequest(prompt="hi", max_tokens=2, adapter="nope"))
    plain = GenerationCore(downstreams, {})  # a core over no fleet serves none
    with pytest.raises(InvalidArgument, match="serves no LoRA adapters"):
        run(plain, GenerationRequest(prompt="hi", max_tokens=2, adapter="sql"))
    assert downstreams.works == []


def test_grpc_status_of_an_unknown_adapter_and_getinfo_adapters(served):
    core, downstreams = served

    async def scenario():
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(core, BASE), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", adapter="nope")):
                        pass
                info = await stub.GetInfo(gateway_pb2.GetInfoRequest())
                return refused.value, info
        finally:
            await downstreams.detokenizer.close()
            await server.stop(None)
    refused, info = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "'nope'" in refused.details()
    assert list(info.adapters) == ["chat", "sql"]
    downstreams.fleet.workers["a:1"].state = "not_serving"  # only the adapters of serving workers are listed
    assert sorted(downstreams.fleet.adapters()) == ["sql"]


@pytest.mark.parametrize("path, body", [("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)])
def test_http_model_naming_an_adapter_selects_it(http, path, body):
    client, downstreams = http
    reply = client.post(path, json={"model": "sql", **body})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "sql"  # as vLLM answers: the adapter's name
    assert downstreams.works[-1].adapter == "sql"
    for base in (BASE, ""):  # the served name, or none: the base model
        reply = client.post(path, json={"model": base, **body})
        assert reply.status_code == 200 and reply.json()["model"] == BASE
        assert downstreams.works[-1].adapter == ""
    sent = len(downstreams.works)
    error = error_of(client.post(path, json={"model": "nope", **body}), 404)
    assert error == {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model",
                     "code": 404}
    assert len(downstreams.works) == sent


def test_every_choice_and_prompt_carries_the_adapter(http):
    client, downstreams = http
    reply = client.post("/v1/completions", json={"model": "chat", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 4
    assert [w.adapter for w in downstreams.works] == ["chat"] * 4


def test_models_lists_each_adapter_with_its_parent_and_root(http):
    client, _ = http
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (BASE, None, "fake"), ("chat", BASE, "/adapters/chat"), ("sql", BASE, "/adapters/sql")]
    assert all(c["object"] == "model" and c["max_model_len"] == 1024 for c in cards)
    assert client.get("/v1/models/sql").json() == cards[2]
    error = error_of(client.get("/v1/models/nope"), 404)
    assert error["code"] == "model_not_found" and "'sql'" in error["message"]


def test_the_openai_client_lists_adapters_and_completes_with_one(served):
    core, downstreams = served
    app = create_app(core, lambda: BASE, lambda: True, "key", 1 << 20)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="key", max_retries=0,
                           http_client=TestClient(app))
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, "chat", "sql"]
    assert [getattr(m, "parent", None) for m in models] == [None, BASE, BASE]
    completion = client.completions.create(model="sql", prompt="hi", max_tokens=3)
    assert completion.model == "sql" and downstreams.works[-1].adapter == "sql"
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "chat" and downstreams.works[-1].adapter == "chat"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
