"""Downstreams over two real in-process tokenizer servers: the one carrying the text streams stops mid-stream,
and every stream's text and every new Encode go on over the other."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.fleet.downstream import Downstreams, DownstreamTLS
from gateway.fleet.fleet_metrics import RESUMED
from gateway.fleet.worker_stream import ResumePolicy
from rpcserver.handlers import add_servicer
from services.tokenizer.servicer import TokenizerServicer
from tests.unit.test_detokenizer_resume import byte_ids
from tests.unit.test_gateway_detokenizer import TEXTS
from vllm_v0.tokenizer.v1 import tokenizer_pb2

WAIT_S = 30.0  # bounds a test that would otherwise hang; never a measure of speed


async def tokenizer_server(core) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add_servicer(server, tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"], TokenizerServicer(core))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_streams_and_encodes_go_on_when_the_tokenizer_carrying_them_stops(demo_tokenizer):
    texts = [*TEXTS, "x" * 20 + " 中文分词 🦜🤗"]
    ids = [byte_ids(demo_tokenizer, t) if n % 2 else demo_tokenizer.encode(t) for n, t in enumerate(texts)]
    half = [len(i) // 2 for i in ids]
    before = RESUMED.labels("tokenizer")._value.get()

    halfway: list[int] = []

    async def stream(downstreams, n, stopped: asyncio.Event):
        text_stream, deltas = downstreams.detokenizer.open(False), []
        for at, token_id in enumerate(ids[n]):
            if at == half[n]:
                halfway.append(n)
                await stopped.wait()
            deltas.append((await text_stream.add([token_id], at == len(ids[n]) - 1))[0])
        return "".join(deltas)

    async def main():
        servers = {address: server for server, address in [await tokenizer_server(demo_tokenizer) for _ in range(2)]}
        downstreams = Downstreams(list(servers), "127.0.0.1:1", DownstreamTLS(), health_interval=0.05,
                                  resume=ResumePolicy(max_resumes=3, wait_s=5.0))
        try:
            await downstreams.start()
            await until(lambda: len(downstreams.tokenizer.serving()) == 2)
            assert (await downstreams.healthy())["tokenizer"]
            stopped = asyncio.Event()
            streams = [asyncio.create_task(stream(downstreams, n, stopped)) for n in range(len(texts))]
            await until(lambda: len(halfway) == len(texts))  # every stream has its first half's text
            carrying = downstreams.tokenizer._decoding.address
            await servers[carrying].stop(None)
            stopped.set()
            results = await asyncio.gather(*streams)
            encodes = [await downstreams.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=t), timeout=5.0)
                       for t in texts[:4]]
            health_after = await downstreams.healthy()
            return carrying, results, encodes, health_after, downstreams.addresses["tokenizer"], list(servers)
        finally:
            await downstreams.close()
            for server in servers.values():
                await server.stop(None)

    carrying, results, encodes, health_after, listed, addresses = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert results == [demo_tokenizer.decode(i) for i in ids]
    assert [list(e.token_ids) for e in encodes] == [demo_tokenizer.encode(t) for t in texts[:4]]
    assert health_after["tokenizer"] and listed == ",".join(addresses)
    assert RESUMED.labels("tokenizer")._value.get() - before == len(texts)  # every stream re-primed once
