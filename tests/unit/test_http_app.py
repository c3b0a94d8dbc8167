"""The HTTP front in-process over fake downstreams (ASGI calls, no sockets): fan-out, SSE framing, errors, key."""
from __future__ import annotations

import asyncio
import json
import unicodedata

import grpc
import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.http_api.http_app import create_app
from rpcserver.status import SharedCallError
from tests.unit.test_generation_core import TEXT, FakeDownstreams, FakeWorkerStream


@pytest.fixture()
def make_client(demo_tokenizer):
    def make(api_key=None, ids=None, model="fake-model"):
        downstreams = FakeDownstreams(demo_tokenizer, ids or demo_tokenizer.encode(TEXT))
        app = create_app(GenerationCore(downstreams, {}), lambda: model, lambda: True, api_key, 1 << 20)
        return TestClient(app), downstreams
    return make


def test_n_choices_non_streaming(make_client, demo_tokenizer):
    client, downstreams = make_client()
    reply = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "n": 3, "seed": 5})
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
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True,
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
    reply = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "temperature": "hot"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "temperature" in reply.json()["error"]["message"]
    reply = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "top_p": 0})
    assert reply.status_code == 400 and "top_p" in reply.json()["error"]["message"]
    reply = client.post("/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["type"] == "invalid_request_error"
    assert downstreams.works == []


def error_of(reply, status: int) -> dict:
    """The OpenAI error object of a reply, checked for its status and its shape."""
    assert reply.status_code == status, reply.text
    assert list(reply.json()) == ["error"], reply.json()
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_routes_and_methods_answer_openai_error_objects(make_client):
    client, _ = make_client()
    error = error_of(client.get("/v1/engines"), 404)
    assert error["type"] == "invalid_request_error" and "GET /v1/engines" in error["message"]
    reply = client.delete("/v1/chat/completions")
    error = error_of(reply, 405)
    assert error["type"] == "invalid_request_error" and "DELETE" in error["message"] and "POST" in error["message"]
    assert reply.headers["allow"] == "POST"


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": 5}, "prompt", "prompt: expected a string or a list"),
    ({"prompt": ["a", 5]}, "prompt[1]", "prompt[1]: Input should be a valid string"),
    ({"prompt": "hi", "stop": 5}, "stop", "stop: expected a string or a list"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "temperature: Input should be a valid number"),
    ({"prompt": "hi", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage",
     "stream_options.include_usage: Input should be a valid boolean"),
    ({"prompt": "hi", "logit_bias": {"50256": "x"}}, 'logit_bias["50256"]', 'logit_bias["50256"]: Input should be'),
    ({}, "prompt", "prompt: Field required"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p must be"),
    ({"prompt": "hi", "n": 0}, "n", "n must be in [1, 16]"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop[1]", "stop[1] is empty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1 (0 only with"),
    ({"prompt": []}, "prompt", "prompt is an empty list"),
    ({"prompt": [[1], [-2]]}, "prompt[1][0]", "prompt[1][0] is -2"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "logit_bias key 'x' is not a token id"),
    ({"prompt": "hi", "logit_bias": {"3": 101}}, 'logit_bias["3"]', 'logit_bias["3"] must be in [-100, 100]'),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type",
     "messages[0].content[0].type: Field required"),
    ({"messages": [{"content": "a"}, {"content": "b"}]}, "messages[0].role", "messages[0].role: Field required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content: expected a string or a list"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": 1}},
     "chat_template_kwargs.enable_thinking", "chat_template_kwargs.enable_thinking must be true or false"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2}, None,
     "give max_completion_tokens or max_tokens, not both"),
])
def test_errors_name_the_field_in_param_without_pydantic_wording(make_client, body, param, says):
    client, downstreams = make_client()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = error_of(client.post(path, json={"model": "fake-model", **body}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(says), error["message"]
    # pydantic's names for the members of a union (prompt.str, content.list[ChatContentPart]) stay out.
    assert not any(tag in error["message"] for tag in (".str", "list[", "ChatContentPart", ".0")), error["message"]
    assert downstreams.works == []


def test_a_body_that_is_not_json_names_no_field(make_client):
    client, _ = make_client()
    error = error_of(client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"}),
                     400)
    assert error["type"] == "invalid_request_error" and error["param"] is None and "JSON" in error["message"]


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
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    for _ in range(2):
        reply = client.post("/v1/completions", json=body, headers={"x-request-id": "mine-1"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "mine-1"
    sent = [w.request_id for w in downstreams.works]
    assert len(set(sent)) == 2 and "mine-1" not in sent
    reply = client.post("/v1/completions", json=body, headers={"x-request-id": "x" * 129})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "at most 128 printable ASCII characters" in reply.json()["error"]["message"]
    assert len(downstreams.works) == 2


def test_retrieve_the_served_model_by_id(make_client):
    client, _ = make_client(model="Qwen/Qwen3-0.6B")
    listed = client.get("/v1/models").json()["data"][0]
    # An id holding a slash arrives as it is or percent-encoded (the openai client encodes it).
    for path in ("/v1/models/Qwen/Qwen3-0.6B", "/v1/models/Qwen%2FQwen3-0.6B"):
        reply = client.get(path)
        assert reply.status_code == 200 and reply.json() == listed
    error = error_of(client.get("/v1/models/Qwen3-0.6B"), 404)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "Qwen3-0.6B" in error["message"] and "Qwen/Qwen3-0.6B" in error["message"]


def test_max_tokens_unset_is_16_for_completions_and_the_context_for_chat(make_client, demo_tokenizer):
    client, downstreams = make_client()
    assert client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"}).status_code == 200
    assert downstreams.works[-1].max_tokens == 16  # OpenAI's and vLLM's default for completions
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    # vLLM's for chat: whatever the context leaves after the prompt.
    assert downstreams.works[-1].max_tokens == 1024 - len(downstreams.works[-1].prompt_token_ids)


class StalledWorkerStream(FakeWorkerStream):
    """Sends its ids, then stalls as a hung engine does, until the request's deadline ends it as the worker mux does."""

    def __init__(self, ids: list[int], timeout: float | None):
        super().__init__(ids, None, None)
        self.timeout = timeout

    async def _steps(self):
        async for step in super()._steps():
            yield step
        if self.timeout is None:
            raise AssertionError("the request reached the worker with no deadline: it would wait forever")
        await asyncio.sleep(self.timeout)
        raise SharedCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class StallingDownstreams(FakeDownstreams):
    def open_worker_stream(self, work, timeout):
        self.works.append(work)
        self.streams.append(StalledWorkerStream(self.ids, timeout))
        return self.streams[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_http_deadline_ends_a_stalled_request(demo_tokenizer, stream):
    downstreams = StallingDownstreams(demo_tokenizer, demo_tokenizer.encode("a few words"))
    app = create_app(GenerationCore(downstreams, {}), lambda: "m", lambda: True, None, 1 << 20,
                     request_timeout_s=0.5)
    body = {"model": "m", "prompt": "hi", "max_tokens": 100, "stream": stream}
    if stream:
        with TestClient(app).stream("POST", "/v1/completions", json=body) as reply:
            lines = [line for line in reply.iter_lines() if line]
        assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"]  # it had started
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
    else:
        error = error_of(TestClient(app).post("/v1/completions", json=body), 504)
    assert error["type"] == "timeout" and "--http-request-timeout" in error["message"], error
    assert 0 < downstreams.streams[0].timeout <= 0.5
    assert downstreams.streams[0].cancelled


def test_a_large_body_is_parsed_and_checked_off_the_event_loop(make_client, monkeypatch):
    """A megabyte of tools is tens of milliseconds of Python objects: past LARGE_BODY_BYTES it is parsed, made
    into requests and checked on a thread, and the loop serves every other stream meanwhile."""
    from gateway.http_api import http_app, openai_protocol

    on_loop = []

    def running_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def spy(fn):
        def call(*args):
            on_loop.append((fn.__name__, running_loop()))
            return fn(*args)
        call.__name__ = fn.__name__
        return call

    monkeypatch.setattr(openai_protocol, "parse", spy(openai_protocol.parse))
    monkeypatch.setattr(http_app, "chat_request", spy(http_app.chat_request))
    client, downstreams = make_client()
    tool = {"type": "function", "function": {"name": "t", "description": "d" * 200,
                                             "parameters": {"type": "object", "properties": {}}}}
    for tools in (1, 400):
        on_loop.clear()
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "tools": [tool] * tools}
        assert (len(json.dumps(body)) > openai_protocol.LARGE_BODY_BYTES) == (tools == 400)
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert on_loop == [("parse", tools == 1), ("chat_request", tools == 1)]
    too_long = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0,
                "tools": [tool] * 400}
    reply = client.post("/v1/chat/completions", json=too_long)  # refused on the thread: the same error object
    assert reply.status_code == 400 and "max_tokens" in reply.json()["error"]["message"]
