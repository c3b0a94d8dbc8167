"""/v1/embeddings through the real `openai` client, /v1/rerank as curl sends it, /v1/score, and their errors,
in-process over fake downstreams (ASGI calls, no sockets)."""
from __future__ import annotations

import asyncio
import base64
import json
import math
import struct

import grpc
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.core.scoring import reranker_prompt
from gateway.http_api.http_app import create_app
from tests.unit.pooling_fakes import (
    HIDDEN_SIZE,
    QUERY_PROMPT,
    FakeWorker,
    FakeWorkerStub,
    fake_downstreams,
    fake_logit,
    raw_vector,
    rpc_error,
    unit,
)


@pytest.fixture()
def make_client(demo_tokenizer):
    def make(api_key=None, workers=None):
        downstreams = fake_downstreams(demo_tokenizer, workers, max_context=256)
        app = create_app(GenerationCore(downstreams, {}), lambda: "fake-model", lambda: True, api_key, 1 << 20)
        return TestClient(app), downstreams
    return make


@pytest.fixture()
def client_and_downstreams(make_client):
    return make_client()


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)


def expected(tokenizer, text: str, dimensions: int = HIDDEN_SIZE) -> list[float]:
    return unit(raw_vector(tokenizer.encode(text))[:dimensions])


def test_openai_client_embeddings_in_float_and_base64(client_and_downstreams, demo_tokenizer):
    http, downstreams = client_and_downstreams
    client = openai_client(http)
    texts = ["first text", "second, longer text 日本語"]
    want = [expected(demo_tokenizer, t) for t in texts]
    # Left unset, the client asks for base64 and decodes it itself.
    for encoding_format in ("float", openai.omit):
        reply = client.embeddings.create(model="fake-model", input=texts, encoding_format=encoding_format)
        assert [d.index for d in reply.data] == [0, 1] and reply.model == "fake-model"
        for got, vector in zip(reply.data, want):
            assert got.embedding == pytest.approx(vector, abs=1e-6)
        tokens = sum(len(demo_tokenizer.encode(t)) for t in texts)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    # Asked for by name, base64 comes back as it was sent.
    reply = client.embeddings.create(model="fake-model", input="first text", dimensions=5, encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(reply.data[0].embedding), dtype="<f4")
    assert decoded.tolist() == pytest.approx(expected(demo_tokenizer, "first text", 5), abs=1e-6)
    assert downstreams.fleet.workers["w1"].stub.requests[-1].dimensions == 5


def test_base64_is_little_endian_float32_of_the_float_values(client_and_downstreams):
    http, _ = client_and_downstreams
    body = {"model": "fake-model", "input": [[11, 12, 13]]}
    floats = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    encoded = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats
    assert floats == pytest.approx(unit(raw_vector([11, 12, 13])), abs=1e-6)


def test_token_id_inputs_and_prompt_name(client_and_downstreams, demo_tokenizer):
    http, downstreams = client_and_downstreams
    reply = http.post("/v1/embeddings", json={"input": [[5, 6], [7]], "prompt_name": "query"}).json()
    sent = [list(i.token_ids) for i in downstreams.fleet.workers["w1"].stub.requests[0].inputs]
    assert sent == [[5, 6], [7]] and reply["usage"]["prompt_tokens"] == 3  # ids take no prompt
    http.post("/v1/embeddings", json={"input": "what?", "prompt_name": "query"})
    assert list(downstreams.fleet.workers["w1"].stub.requests[1].inputs[0].token_ids) == \
        demo_tokenizer.encode(QUERY_PROMPT + "what?")


def rerank_scores(tokenizer, query: str, documents: list[str]) -> list[float]:
    yes, no = tokenizer.encode("yes")[0], tokenizer.encode("no")[0]
    scores = []
    for document in documents:
        ids = tokenizer.encode(reranker_prompt(query, document))
        scores.append(1 / (1 + math.exp(fake_logit(ids, no) - fake_logit(ids, yes))))
    return scores


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance_and_cuts_to_top_n(client_and_downstreams, demo_tokenizer, path):
    http, _ = client_and_downstreams
    documents = ["Paris is in France.", "Bananas are yellow.", "France's capital is Paris.", "Tokyo."]
    reply = http.post(path, json={"model": "fake-model", "query": "capital of France?", "top_n": 3,
                                  "documents": [documents[0], {"text": documents[1]}, *documents[2:]]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    scores = rerank_scores(demo_tokenizer, "capital of France?", documents)
    order = sorted(range(4), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert [r["document"]["text"] for r in body["results"]] == [documents[i] for i in order]
    assert body["model"] == "fake-model" and body["id"].startswith("rerank-")
    assert body["usage"]["total_tokens"] == sum(
        len(demo_tokenizer.encode(reranker_prompt("capital of France?", d))) for d in documents)
    bare = http.post(path, json={"query": "q", "documents": ["a", "b"], "return_documents": False}).json()
    assert len(bare["results"]) == 2 and all(set(r) == {"index", "relevance_score"} for r in bare["results"])


def test_score_pairs_one_to_many_and_many_to_many(client_and_downstreams, demo_tokenizer):
    http, _ = client_and_downstreams
    one = http.post("/v1/score", json={"text_1": "q", "text_2": ["a", "b", "c"]}).json()
    assert [d["index"] for d in one["data"]] == [0, 1, 2] and one["object"] == "list"
    assert [d["score"] for d in one["data"]] == pytest.approx(rerank_scores(demo_tokenizer, "q", ["a", "b", "c"]),
                                                              abs=1e-6)
    many = http.post("/score", json={"text_1": ["q", "r"], "text_2": ["a", "b"]}).json()
    want = [rerank_scores(demo_tokenizer, "q", ["a"])[0], rerank_scores(demo_tokenizer, "r", ["b"])[0]]
    assert [d["score"] for d in many["data"]] == pytest.approx(want, abs=1e-6)
    assert many["usage"]["completion_tokens"] == 0 and many["usage"]["prompt_tokens"] > 0


def error_of(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path, body, status, param, says", [
    ("/v1/embeddings", {"input": ""}, 400, "input[0]", "input[0] is empty"),
    ("/v1/embeddings", {"input": []}, 400, "input", "input is empty"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, 400, "dimensions", "dimensions must be at least 1"),
    ("/v1/embeddings", {"input": "a", "dimensions": HIDDEN_SIZE + 1}, 400, "dimensions", "dimensions must be in"),
    ("/v1/embeddings", {"input": [list(range(300))]}, 400, "input[0]", "input[0] is 300 tokens; at most 256"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "binary"}, 400, "encoding_format", "encoding_format"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 5}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens is not a supported field"),
    ("/v1/embeddings", {"input": "a", "prompt_name": "nope"}, 400, "prompt_name", "prompt_name 'nope'"),
    ("/v1/embeddings", {"input": "a", "model": "other"}, 404, "model", "does not exist"),
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents", "documents is empty"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, 400, "query", "query is empty"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n", "top_n must be >= 0"),
    ("/v1/rerank", {"documents": ["d"]}, 400, "query", "query: Field required"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1", "pair them 1:1, 1:N or N:N"),
    ("/v1/score", {"text_1": "a", "text_2": []}, 400, "text_2", "text_2 is an empty list"),
])
def test_refusals_are_openai_errors_naming_the_field(client_and_downstreams, path, body, status, param, says):
    http, downstreams = client_and_downstreams
    error = error_of(http.post(path, json=body), status)
    assert error["param"] == param and says in error["message"], error
    assert downstreams.fleet.workers["w1"].stub.requests == []


def test_api_key_and_request_id(make_client):
    http, _ = make_client(api_key="k1")
    assert error_of(http.post("/v1/embeddings", json={"input": "a"}), 401)["type"] == "authentication_error"
    reply = http.post("/v1/rerank", json={"query": "q", "documents": ["d"]},
                      headers={"authorization": "Bearer k1", "x-request-id": "trace-7"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-7"
    assert reply.json()["id"] == "rerank-trace-7"
    bad = http.post("/v1/score", json={"text_1": "q", "text_2": "d"},
                    headers={"authorization": "Bearer k1", "x-request-id": "a b"})
    assert error_of(bad, 400)["message"].startswith("request_id has")


@pytest.mark.parametrize("code, status", [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                          (grpc.StatusCode.UNAVAILABLE, 503)])
def test_worker_failures_map_to_http_statuses(make_client, code, status):
    http, _ = make_client(workers=[FakeWorker("w1", [rpc_error(code, "busy")] * 10)])
    error = error_of(http.post("/v1/embeddings", json={"input": "a"}), status)
    assert "busy" in error["message"] or "no model worker" in error["message"]


def test_no_worker_yet_is_503(client_and_downstreams):
    http, downstreams = client_and_downstreams
    downstreams.worker_info = None
    assert error_of(http.post("/v1/rerank", json={"query": "q", "documents": ["d"]}), 503)["type"] == \
        "service_unavailable"


def test_each_request_is_counted_by_kind_and_status(client_and_downstreams):
    from prometheus_client import REGISTRY

    def count(kind: str, code: str) -> float:
        return REGISTRY.get_sample_value("vllm_v0_gateway_pooling_requests_total", {"kind": kind, "code": code}) or 0

    http, _ = client_and_downstreams
    before = count("embed", "OK"), count("embed", "INVALID_ARGUMENT"), count("score", "OK")
    tokens = REGISTRY.get_sample_value("vllm_v0_gateway_pooling_prompt_tokens_total", {"kind": "embed"}) or 0
    http.post("/v1/embeddings", json={"input": [[1, 2, 3]]})
    http.post("/v1/embeddings", json={"input": []})
    http.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert (count("embed", "OK"), count("embed", "INVALID_ARGUMENT"), count("score", "OK")) == \
        (before[0] + 1, before[1] + 1, before[2] + 1)
    assert REGISTRY.get_sample_value("vllm_v0_gateway_pooling_prompt_tokens_total", {"kind": "embed"}) == tokens + 3


class StuckStub(FakeWorkerStub):
    """A worker whose calls never answer; it records each one that is cancelled (the gRPC call would be)."""

    def __init__(self):
        super().__init__()
        self.started = asyncio.Event()
        self.cancelled = 0

    async def hang(self, request, timeout=None):
        self.requests.append(request)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    Embed = Score = hang


@pytest.mark.parametrize("route, body", [
    ("/v1/embeddings", {"model": "fake-model", "input": ["a", "b"]}),
    ("/v1/rerank", {"model": "fake-model", "query": "q", "documents": ["d1", "d2"]}),
    ("/v1/score", {"model": "fake-model", "text_1": "q", "text_2": "d"}),
])
def test_a_client_that_goes_away_cancels_the_workers_calls(demo_tokenizer, route, body):
    """A non-streaming response writes nothing until its end, so the gateway listens for the disconnect: the
    worker calls are cancelled (their inputs dropped from the engine), not left to run for nobody."""
    worker = FakeWorker("w1")
    worker.stub = stub = StuckStub()
    app = create_app(GenerationCore(fake_downstreams(demo_tokenizer, [worker], max_context=256), {}),
                     lambda: "fake-model", lambda: True, None, 1 << 20)
    payload = json.dumps(body).encode()

    async def main():
        sent = []
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await stub.started.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
                 "client": ("127.0.0.1", 1), "server": ("testserver", 80), "root_path": ""}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    sent = asyncio.run(main())
    assert stub.requests and stub.cancelled == len(stub.requests)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
