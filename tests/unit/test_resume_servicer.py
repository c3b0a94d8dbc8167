"""GenerateRequest.output_token_ids through the worker's servicer (Generate and GenerateMany) on a real grpc.aio
server on port 0, over a real engine core: the stream carries the tokens after the given ids, and only those."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from rpcserver.handlers import add_servicer
from services.model_worker.core.client import EngineClient
from services.model_worker.server.servicer import ModelWorkerServicer
from tests.checkpoints import make_checkpoint
from tests.unit.test_batching import greedy, make_engine
from tests.unit.test_engine_client import START_S, WAIT_S, core_config
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

PROMPT = [12, 7, 300, 41, 5]
LENGTH = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-resume-servicer")
    make_checkpoint(path, eos_token_id=())
    return path


def request(request_id: str, output_ids: list[int], **extra) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT, max_tokens=LENGTH,
                                      ignore_eos=True, sampling=worker_pb2.SamplingParams(temperature=0.0),
                                      output_token_ids=output_ids, **extra)


def test_both_rpcs_go_on_after_the_given_ids(checkpoint):
    want = make_engine(checkpoint).generate([PROMPT], greedy(LENGTH))[0]

    async def main():
        client = EngineClient(checkpoint, core_config())
        await asyncio.wait_for(client.start(), START_S)
        server = grpc.aio.server()
        add_servicer(server, worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"],
                     ModelWorkerServicer("tiny", client))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
                single = [m async for m in stub.Generate(request("one", want[:10]), timeout=WAIT_S)]
                many = stub.GenerateMany(timeout=WAIT_S)
                await many.write(worker_pb2.GenerateManyRequest(start=request("m", want[:20])))
                await many.write(worker_pb2.GenerateManyRequest(start=request("bad", want[:3], prompt_logprobs=1)))
                await many.done_writing()
                outputs = [o async for response in many for o in response.outputs]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    _ = [m async for m in stub.Generate(request("long", want[:LENGTH]), timeout=WAIT_S)]
                return single, outputs, refused.value
        finally:
            await server.stop(None)
            await client.close()

    single, outputs, refused = asyncio.run(main())
    assert [m.token_id for m in single] == want[10:]
    assert single[0].prompt_tokens == len(PROMPT) and single[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert [o.step.token_id for o in outputs if o.request_id == "m"] == want[20:]
    (bad,) = [o for o in outputs if o.request_id == "bad"]
    assert bad.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "prompt_logprobs" in bad.error_message
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "nothing is left to generate" in refused.details()
