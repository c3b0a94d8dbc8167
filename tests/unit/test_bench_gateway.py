"""The gateway benchmark's HTTP client: the request it sends is one the gateway serves, and a refusal stops it."""
from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from bench.bench_gateway import completion_body, http_stream
from gateway.core.generation import GenerationCore
from gateway.http_api.http_app import create_app
from tests.unit.test_generation_core import TEXT, FakeDownstreams


def test_the_benchmarks_completion_is_served_whatever_the_served_models_name(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXT)
    app = create_app(GenerationCore(FakeDownstreams(demo_tokenizer, ids), {}), lambda: "Qwen/Qwen3-0.6B",
                     lambda: True, None, 1 << 20)
    reply = TestClient(app).post("/v1/completions", content=completion_body("hi", len(ids)),
                                 headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == len(ids) and reply.text.endswith("data: [DONE]\n\n")
    # Every event says the tokens so far, from which the benchmark stamps each token.
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[0] >= 1


def test_a_refused_benchmark_request_raises_rather_than_timing_nothing():
    async def refuse(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error": {"message": "The model `m` does not exist."}}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(refuse, "127.0.0.1", 0)
        async with server:
            await http_stream(server.sockets[0].getsockname()[1], "hi", 4)

    with pytest.raises(RuntimeError, match="404"):
        asyncio.run(run())
