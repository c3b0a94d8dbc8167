"""The HTTP front in-process over fake downstreams (ASGI calls, no sockets): fan-out, SSE framing, errors, key."""
from __future__ import annotations

import json
import unicodedata

import pytest
from starlette.testclient import TestClient

from gateway.generation import GenerationCore
from gateway.http_app import create_app
from tests.unit.test_generation_core import TEXT, FakeDownstreams


@pytest.fixture()
def make_client(demo_tokenizer):
    def make(api_key=None, ids=None):
        downstreams = FakeDownstreams(demo_tokenizer, ids or demo_tokenizer.encode(TEXT))
        app = create_app(GenerationCore(downstreams, {}), lambda: "fake-model", lambda: True, api_key, 1 << 20)
        return TestClient(app), downstreams
    return make


def test_n_choices_non_streaming(make_client, demo_tokenizer):
    client, downstreams = make_client()
    reply = client.post("/v1/completions", json={"model": "x", "prompt": "hi", "n": 3, "seed": 5})
    assert reply.status_code == 200
    body = reply.json()
    want = unicodedata.normalize("NFC", TEXT)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == want and c["finish_reason"] == "length" for c in body["choices"])
    assert [w.sampling.seed for w in downstreams.works] == [5, 6, 7]
    assert body["usage"]["completion_tokens"] == 3 * len(demo_tokenizer.encode(TEXT))


def test_n_choices_streaming_events(make_client):
    client, _ = make_client()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "x", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"]["content"] for c in mine) == unicodedata.normalize("NFC", TEXT)
        assert mine[-1]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_errors_are_openai_error_objects(make_client):
    client, downstreams = make_client()
    reply = client.post("/v1/completions", json={"model": "x", "prompt": "hi", "temperature": "hot"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "temperature" in reply.json()["error"]["message"]
    reply = client.post("/v1/completions", json={"model": "x", "prompt": "hi", "top_p": 0})
    assert reply.status_code == 400 and "top_p" in reply.json()["error"]["message"]
    reply = client.post("/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert downstreams.works == []


def test_api_key(make_client):
    client, _ = make_client(api_key="k1")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"authorization": "Bearer nope"}).json()["error"]["type"] == \
        "authentication_error"
    models = client.get("/v1/models", headers={"authorization": "Bearer k1"}).json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 1024
    assert client.get("/health").status_code == 200  # open, as gRPC health


def test_request_id_header_is_checked_echoed_and_not_sent_to_the_worker(make_client):
    client, downstreams = make_client()
    body = {"model": "x", "prompt": "hi", "max_tokens": 2}
    for _ in range(2):
        reply = client.post("/v1/completions", json=body, headers={"x-request-id": "mine-1"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "mine-1"
    sent = [w.request_id for w in downstreams.works]
    assert len(set(sent)) == 2 and "mine-1" not in sent
    reply = client.post("/v1/completions", json=body, headers={"x-request-id": "x" * 129})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "at most 128 printable ASCII characters" in reply.json()["error"]["message"]
    assert len(downstreams.works) == 2
