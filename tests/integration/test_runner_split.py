"""One checkpoint on two workers, one started with --runner generate and one with --runner pooling, behind one
gateway: every embedding goes to the pooling worker and every generation to the generating one, through the real
`openai` client; asked directly, each worker refuses the kind its runner leaves out."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from tests.integration.stack import Service, free_port, wait_serving, wait_workers_serving
from tests.integration.test_metrics import scrape, value
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture()
def split(checkpoint, tmp_path):
    """A tokenizer, a generating worker, a pooling worker (each with metrics) and a gateway with HTTP on them."""
    tokenizer = Service("tokenizer", ["services.tokenizer", "--model", str(checkpoint)], free_port(),
                        str(tmp_path / "tokenizer.log"))
    workers = {runner: Service(f"worker-{runner}", ["services.model_worker", "--model", str(checkpoint), "--dtype",
                                                    "float32", "--runner", runner, "--metrics-port", str(free_port())],
                               free_port(), str(tmp_path / f"worker-{runner}.log"))
               for runner in ("generate", "pooling")}
    http_port = free_port()
    gateway = Service("gateway", ["gateway", "--tokenizer-addr", tokenizer.address, "--worker-addr",
                                  ",".join(w.address for w in workers.values()), "--http-port", str(http_port)],
                      free_port(), str(tmp_path / "gateway.log"))
    everything = [tokenizer, *workers.values(), gateway]
    try:
        for service in everything:
            service.start()
        for service in everything:
            wait_serving(service.address, timeout=120)
        wait_workers_serving(gateway, 2)  # each kind's routing needs the gateway to have heard from both
        yield workers, f"http://127.0.0.1:{http_port}/v1"
    finally:
        for service in reversed(everything):
            service.stop()


def started(service: Service, method: str) -> float:
    port = int(service.args[service.args.index("--metrics-port") + 1])
    return value(scrape(port), "grpc_server_started_total", grpc_method=method)


def test_each_kind_reaches_only_the_worker_that_serves_it(split):
    workers, base_url = split
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        with ThreadPoolExecutor(8) as pool:
            embeddings = list(pool.map(lambda i: client.embeddings.create(model="", input=[f"text {i}", "more"]),
                                       range(6)))
            completions = list(pool.map(lambda i: client.completions.create(
                model="", prompt=f"Count {i}:", max_tokens=4, extra_body={"ignore_eos": True}), range(6)))
    assert all(len(reply.data) == 2 for reply in embeddings)
    assert all(reply.usage.completion_tokens == 4 for reply in completions)
    assert started(workers["pooling"], "Embed") >= 6 and started(workers["generate"], "Embed") == 0
    generations = sum(started(workers["generate"], m) for m in ("Generate", "GenerateMany"))
    assert generations >= 1
    assert sum(started(workers["pooling"], m) for m in ("Generate", "GenerateMany")) == 0

    for runner, service in workers.items():
        with grpc.insecure_channel(service.address) as channel:
            stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
            assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30).runner == runner
            with pytest.raises(grpc.RpcError) as refused:
                if runner == "generate":
                    stub.Embed(worker_pb2.EmbedRequest(request_id="e", inputs=[worker_pb2.TokenIds(token_ids=[1])]),
                               timeout=30)
                else:
                    list(stub.Generate(worker_pb2.GenerateRequest(request_id="g", prompt_token_ids=[1, 2],
                                                                  max_tokens=2), timeout=30))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"--runner {runner}" in refused.value.details()
