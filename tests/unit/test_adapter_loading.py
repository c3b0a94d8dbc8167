"""Loading and unloading LoRA adapters through the gateway's HTTP routes: forwarded to every serving worker (fake
workers on real gRPC servers), their errors mapped as vLLM answers, a partial failure named worker by worker."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gateway.core.generation import GenerationCore
from gateway.fleet.adapters import Adapters
from gateway.fleet.router import Router
from gateway.fleet.workers import SERVING, Fleet, Worker
from gateway.http_api.http_app import create_app
from tests.unit.test_generation_core import TEXT, FakeDownstreams
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

BASE = "fake-model"
KEY = {"authorization": "Bearer k1"}
SQL = {"lora_name": "sql", "lora_path": "/adapters/sql"}


class LoraWorker(worker_pb2_grpc.ModelWorkerServiceServicer):
    """A worker's adapter RPCs as worker.proto words them; `refuse` = (code, message) fails every LoadAdapter."""

    def __init__(self, refuse: tuple[grpc.StatusCode, str] | None = None):
        self.adapters: dict[str, worker_pb2.AdapterInfo] = {}
        self.refuse = refuse
        self.loads: list[worker_pb2.LoadAdapterRequest] = []
        self.unloads: list[str] = []

    async def GetInfo(self, request, context):
        return worker_pb2.GetInfoResponse(model="fake", max_context=1024, adapters=list(self.adapters.values()))

    async def LoadAdapter(self, request, context):
        self.loads.append(request)
        if self.refuse is not None:
            await context.abort(*self.refuse)
        if request.name in self.adapters:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"an adapter named {request.name!r} is loaded")
        self.adapters[request.name] = worker_pb2.AdapterInfo(name=request.name, path=request.path, rank=8)
        return worker_pb2.LoadAdapterResponse(adapter=self.adapters[request.name])

    async def UnloadAdapter(self, request, context):
        self.unloads.append(request.name)
        if self.adapters.pop(request.name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter named {request.name!r}")
        return worker_pb2.UnloadAdapterResponse()


class Gateway:
    """The HTTP front over a fleet of these workers, each on a gRPC server of its own on port 0."""

    def __init__(self, servicers, demo_tokenizer):
        self.servicers, self.demo_tokenizer = servicers, demo_tokenizer

    async def __aenter__(self):
        self.servers, self.fleet = [], Fleet([], grpc.aio.insecure_channel, 30.0, Router())
        for servicer in self.servicers:
            server = grpc.aio.server()
            worker_pb2_grpc.add_ModelWorkerServiceServicer_to_server(servicer, server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            self.servers.append(server)
            worker = Worker(address, grpc.aio.insecure_channel(address), 30.0)
            worker.state = SERVING
            await worker.refresh_info()
            self.fleet.workers[address] = worker
        self.addresses = list(self.fleet.workers)
        downstreams = FakeDownstreams(self.demo_tokenizer, self.demo_tokenizer.encode(TEXT))
        core = GenerationCore(downstreams, {}, adapters=Adapters(self.fleet))
        app = create_app(core, lambda: BASE, lambda: True, "k1", 1 << 20)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                                        headers=KEY)
        return self

    async def __aexit__(self, *exc):
        await self.client.aclose()
        await self.fleet.close()
        for server in self.servers:
            await server.stop(None)

    async def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return await self.client.post(path, json=body, **kwargs)

    async def listed(self) -> list[str]:
        return [card["id"] for card in (await self.client.get("/v1/models")).json()["data"]]


def scenario(demo_tokenizer, servicers, steps):
    async def run():
        async with Gateway(servicers, demo_tokenizer) as gateway:
            await steps(gateway)
    asyncio.run(run())


def error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def test_load_and_unload_reach_every_serving_worker(demo_tokenizer):
    workers = [LoraWorker(), LoraWorker()]

    async def steps(gateway: Gateway):
        reply = await gateway.post("/v1/load_lora_adapter", SQL)
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        assert [[(r.name, r.path) for r in w.loads] for w in workers] == [[("sql", "/adapters/sql")]] * 2
        # Routing and listing see it at once, not at the next health check.
        assert await gateway.listed() == [BASE, "sql"]
        assert {gateway.fleet.pick(list(range(20)), adapter="sql").address for _ in range(4)} == \
            set(gateway.addresses)
        reply = await gateway.post("/v1/load_lora_adapter", SQL)
        assert error(reply, 400) == {"message": "The lora adapter 'sql' has already been loaded.",
                                     "type": "BadRequestError", "param": None, "code": 400}
        assert all(len(w.loads) == 1 for w in workers)  # nothing was asked of the workers
        reply = await gateway.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        assert [w.unloads for w in workers] == [["sql"]] * 2 and not any(w.adapters for w in workers)
        assert await gateway.listed() == [BASE]
        assert gateway.fleet.pick(list(range(20)), adapter="sql") is None
        reply = await gateway.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert error(reply, 404) == {"message": "The lora adapter 'sql' cannot be found.", "type": "NotFoundError",
                                     "param": None, "code": 404}
    scenario(demo_tokenizer, workers, steps)


@pytest.mark.parametrize("refusal, status, kind, words", [
    ((grpc.StatusCode.INVALID_ARGUMENT, "/adapters/sql has no adapter_config.json"), 400, "BadRequestError",
     "/adapters/sql has no adapter_config.json"),
    ((grpc.StatusCode.INVALID_ARGUMENT, "the adapter's rank r=64 is over this worker's --max-lora-rank 16"), 400,
     "BadRequestError", "the adapter's rank r=64 is over this worker's --max-lora-rank 16"),
    ((grpc.StatusCode.FAILED_PRECONDITION, "LoRA is off"), 400, "BadRequestError", "start it with --enable-lora"),
    ((grpc.StatusCode.NOT_FOUND, "no such folder"), 404, "NotFoundError", "no such folder"),
    ((grpc.StatusCode.RESOURCE_EXHAUSTED, "4 adapters resident, none idle"), 429, "rate_limit_error",
     "4 adapters resident, none idle"),
])
def test_a_refusal_every_worker_gives_is_answered_in_its_words(demo_tokenizer, refusal, status, kind, words):
    workers = [LoraWorker(refusal), LoraWorker(refusal)]

    async def steps(gateway: Gateway):
        body = error(await gateway.post("/v1/load_lora_adapter", SQL), status)
        assert body["type"] == kind and words in body["message"], body
        assert " of 2 model workers" not in body["message"]  # the same words from each: said once
        assert await gateway.listed() == [BASE]
    scenario(demo_tokenizer, workers, steps)


class OlderWorker(worker_pb2_grpc.ModelWorkerServiceServicer):
    """A worker from before adapters: its GetInfo answers, LoadAdapter is UNIMPLEMENTED."""

    async def GetInfo(self, request, context):
        return worker_pb2.GetInfoResponse(model="fake", max_context=1024)


def test_workers_that_cannot_serve_adapters_are_501(demo_tokenizer):
    async def steps(gateway: Gateway):
        body = error(await gateway.post("/v1/load_lora_adapter", SQL), 501)
        assert "cannot serve LoRA adapters" in body["message"]
    scenario(demo_tokenizer, [OlderWorker()], steps)


def test_a_partial_failure_names_the_workers_and_loading_again_completes_the_fleet(demo_tokenizer):
    good, refusing = LoraWorker(), LoraWorker((grpc.StatusCode.INVALID_ARGUMENT, "rank r=64 is over 16"))

    async def steps(gateway: Gateway):
        first, second = gateway.addresses
        body = error(await gateway.post("/v1/load_lora_adapter", SQL), 400)
        assert body["message"].startswith(f"could not load 'sql' on 1 of 2 model workers ({second}: rank r=64 is "
                                          f"over 16); it is loaded on {first}"), body
        # Requests naming it go where it is loaded.
        assert {gateway.fleet.pick(list(range(20)), adapter="sql").address for _ in range(4)} == {first}
        assert await gateway.listed() == [BASE, "sql"]
        refusing.refuse = None  # fixed (a worker with a larger --max-lora-rank, say)
        reply = await gateway.post("/v1/load_lora_adapter", SQL)
        assert reply.status_code == 200, reply.text
        assert (len(good.loads), len(refusing.loads)) == (1, 2)  # only the worker that lacked it was asked again
        assert {gateway.fleet.pick(list(range(20)), adapter="sql").address for _ in range(4)} == {first, second}
    scenario(demo_tokenizer, [good, refusing], steps)


def test_unload_from_a_fleet_where_some_workers_lack_it(demo_tokenizer):
    has, lacks = LoraWorker(), LoraWorker()
    has.adapters["sql"] = worker_pb2.AdapterInfo(name="sql", path="/adapters/sql", rank=8)

    async def steps(gateway: Gateway):
        reply = await gateway.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert reply.status_code == 200 and not has.adapters and lacks.unloads == ["sql"]
    scenario(demo_tokenizer, [has, lacks], steps)


def test_the_routes_check_the_key_and_the_body(demo_tokenizer):
    workers = [LoraWorker()]

    async def steps(gateway: Gateway):
        for path, body in (("/v1/load_lora_adapter", SQL), ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
            assert error(await gateway.post(path, body, headers={"authorization": "Bearer no"}), 401)
        message = "Both 'lora_name' and 'lora_path' must be provided."
        assert error(await gateway.post("/v1/load_lora_adapter", {"lora_name": "sql"}), 400)["message"] == message
        assert "base model" in error(await gateway.post("/v1/load_lora_adapter",
                                                        {"lora_name": BASE, "lora_path": "/a"}), 400)["message"]
        refused = error(await gateway.post("/v1/unload_lora_adapter", {}), 400)
        assert refused["message"] == "'lora_name' must be provided."
        assert error(await gateway.post("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/a"}), 400)
        assert workers[0].loads == [] and workers[0].unloads == []
        for worker in gateway.fleet.workers.values():
            worker.state = "not_serving"
        body = error(await gateway.post("/v1/load_lora_adapter", SQL), 503)
        assert "no model worker is serving" in body["message"]
    scenario(demo_tokenizer, workers, steps)


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_worker_that_comes_to_serve_without_them_gets_the_adapters_loaded_at_runtime():
    """A worker forgets runtime-loaded adapters when it restarts: once it serves again, the gateway loads each it
    lacks there, so the fleet stays whole; an adapter unloaded since is not loaded again."""
    first, second = LoraWorker(), LoraWorker()

    async def run():
        servers, healths, addresses = [], [], []
        for servicer in (first, second):
            server = grpc.aio.server()
            worker_pb2_grpc.add_ModelWorkerServiceServicer_to_server(servicer, server)
            health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
            healths.append(health)
        fleet = Fleet(addresses, grpc.aio.insecure_channel, 0.1, Router())
        adapters = Adapters(fleet)
        await fleet.start()
        try:
            await until(lambda: len(fleet.serving()) == 2)
            await adapters.load("sql", "/adapters/sql", timeout=5)
            assert (len(first.loads), len(second.loads)) == (1, 1)

            async def restart_second() -> None:
                await healths[1].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await until(lambda: not fleet.workers[addresses[1]].serving)
                second.adapters.clear()  # a fresh process: only its --lora-modules, here none
                await healths[1].set("", health_pb2.HealthCheckResponse.SERVING)
                await until(lambda: fleet.workers[addresses[1]].serving)

            await restart_second()
            await until(lambda: fleet.workers[addresses[1]].has_adapter("sql"))
            assert "sql" in second.adapters and (len(first.loads), len(second.loads)) == (1, 2)
            assert {fleet.pick(list(range(20)), adapter="sql").address for _ in range(4)} == set(addresses)

            await adapters.unload("sql", timeout=5)
            await restart_second()
            await asyncio.sleep(0.3)  # several health checks: nothing is loaded
            assert not second.adapters and len(second.loads) == 2
        finally:
            await fleet.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(run())
