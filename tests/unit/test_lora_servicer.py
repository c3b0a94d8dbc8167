"""LoRA adapters through the worker's gRPC surface on a real grpc.aio server on port 0, over a real engine core:
--lora-modules at start, LoadAdapter / UnloadAdapter, GetInfo's adapters, Generate and GenerateMany's adapter."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from rpcserver.handlers import add_servicer
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core.client import EngineClient
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.server.servicer import ModelWorkerServicer
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter
from tests.unit.test_engine_client import START_S, WAIT_S, core_config
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

PROMPT = [12, 7, 300, 41, 5]
LENGTH = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-servicer-base")
    make_checkpoint(path, eos_token_id=())
    adapters = {}
    for name, rank in (("first", 8), ("second", 16)):
        adapters[name] = tmp_path_factory.mktemp(name)
        make_adapter(path, adapters[name], rank=rank, seed=rank)
    return path, adapters


def lora_config(adapters) -> EngineConfig:
    return dataclasses.replace(core_config(), enable_lora=True, max_loras=2,
                               lora_modules=(("first", str(adapters["first"])),))


def request(request_id: str, adapter: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT, max_tokens=LENGTH,
                                      ignore_eos=True, sampling=worker_pb2.SamplingParams(temperature=0.0),
                                      adapter=adapter)


async def serve(client: EngineClient, scenario):
    server = grpc.aio.server()
    add_servicer(server, worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"],
                 ModelWorkerServicer("tiny", client))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await scenario(worker_pb2_grpc.ModelWorkerServiceStub(channel))
    finally:
        await server.stop(None)


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value


def test_adapters_through_grpc(folders):
    path, adapters = folders
    reference = LLMEngine(path, lora_config(adapters))
    reference.load_adapter("second", str(adapters["second"]))
    params = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True)
    want = {}
    for adapter in ("", "first", "second"):
        reference.add_request(adapter or "base", PROMPT, params, adapter=adapter)
    while reference.has_work():
        for out in reference.step():
            want.setdefault(out.request_id, []).append(out.token_id)

    async def scenario(stub):
        seen = {}
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=WAIT_S)
        seen["start"] = [(a.name, a.rank) for a in info.adapters]
        loaded = await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name="second", path=str(adapters["second"])),
                                        timeout=WAIT_S)
        seen["loaded"] = (loaded.adapter.name, loaded.adapter.rank, loaded.adapter.path)
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=WAIT_S)
        seen["both"] = sorted(a.name for a in info.adapters)
        seen["first"] = [m.token_id async for m in stub.Generate(request("one", "first"), timeout=WAIT_S)]
        many = stub.GenerateMany(timeout=WAIT_S)
        for rid, adapter in (("m-base", ""), ("m-second", "second"), ("m-bad", "nope")):
            await many.write(worker_pb2.GenerateManyRequest(start=request(rid, adapter)))
        await many.done_writing()
        outputs = [o async for response in many for o in response.outputs]
        seen["many"] = {rid: [o.step.token_id for o in outputs if o.request_id == rid]
                        for rid in ("m-base", "m-second")}
        seen["bad"] = [(o.error_code, o.error_message) for o in outputs if o.request_id == "m-bad"]
        seen["missing"] = await refused(stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name="x", path="/nonexistent"),
                                                         timeout=WAIT_S))
        seen["full"] = await refused(stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name="first",
                                                                                    path=str(adapters["first"])),
                                                      timeout=WAIT_S))
        await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="second"), timeout=WAIT_S)
        seen["unknown"] = await refused(stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="second"),
                                                           timeout=WAIT_S))
        seen["gone"] = await refused(stub.Generate(request("late", "second"), timeout=WAIT_S).read())
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=WAIT_S)
        seen["after"] = [a.name for a in info.adapters]
        return seen

    async def main():
        client = EngineClient(path, lora_config(adapters))
        await asyncio.wait_for(client.start(), START_S)
        try:
            return await serve(client, scenario)
        finally:
            await client.close()

    seen = asyncio.run(main())
    assert seen["start"] == [("first", 8)]
    assert seen["loaded"] == ("second", 16, str(adapters["second"]))
    assert seen["both"] == ["first", "second"]
    assert seen["first"] == want["first"]
    assert seen["many"] == {"m-base": want["base"], "m-second": want["second"]}
    assert len({tuple(t) for t in want.values()}) == 3  # the adapters change the tokens
    assert seen["bad"] == [(grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            "unknown adapter 'nope' (loaded: first, second)")]
    assert seen["missing"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no adapter folder" in seen["missing"].details()
    assert seen["full"].code() == grpc.StatusCode.INVALID_ARGUMENT and "already loaded" in seen["full"].details()
    assert seen["unknown"].code() == grpc.StatusCode.NOT_FOUND
    assert seen["gone"].code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown adapter" in seen["gone"].details()
    assert seen["after"] == ["first"]


def test_lora_off(folders):
    path, _ = folders
    client = EngineClient(path, core_config())  # never started: these are refused before any core is asked

    async def scenario(stub):
        load = await refused(stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name="x", path="/tmp"), timeout=WAIT_S))
        return load

    load = asyncio.run(serve(client, scenario))
    assert load.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert load.details() == "LoRA adapters are not enabled (--enable-lora)"
    with pytest.raises(Exception, match=r"LoRA adapters are not enabled \(--enable-lora\)"):
        client.check_adapter("x")
