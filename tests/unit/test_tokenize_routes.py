"""vLLM's /tokenize and /detokenize routes over the real tokenizer core, checked against transformers."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.http_api.http_app import create_app
from tests.unit.test_generation_core import FakeDownstreams
from tests.unit.test_http_app import error_of
from tests.unit.test_tool_calls_api import ASK, WEATHER, RenderingTokenizer

CONVERSATION = [*ASK,
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_a", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}]


class CountingTokenizer(RenderingTokenizer):
    """The tokenizer service, counting the calls the routes make."""

    def __init__(self, core):
        super().__init__(core)
        self.called: list[str] = []

    async def Encode(self, request, timeout=None):
        self.called.append("Encode")
        return await super().Encode(request, timeout)

    async def Decode(self, request, timeout=None):
        self.called.append("Decode")
        return await super().Decode(request, timeout)


def routes(demo_tokenizer, worker: bool = True) -> tuple[TestClient, CountingTokenizer]:
    """The HTTP front serving "qwen3"; without a worker, as while one restarts or before one is up."""
    downstreams = FakeDownstreams(demo_tokenizer, [])
    downstreams.tokenizer = CountingTokenizer(demo_tokenizer)
    if not worker:
        downstreams.worker_info = None
    app = create_app(GenerationCore(downstreams, {}), lambda: "qwen3", lambda: worker, None, 1 << 20)
    return TestClient(app), downstreams.tokenizer


@pytest.fixture()
def client(demo_tokenizer):
    return routes(demo_tokenizer)[0]


def test_tokenize_a_prompt(client, hf_demo_tokenizer):
    text = "Hello, 世界 <|im_start|> 🎉"
    body = client.post("/tokenize", json={"model": "qwen3", "prompt": text}).json()
    want = hf_demo_tokenizer(text)["input_ids"]
    assert body == {"count": len(want), "max_model_len": 1024, "tokens": want, "token_strs": None}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("thinking", [None, False])
def test_tokenize_messages_with_tools(client, hf_demo_tokenizer, add_generation_prompt, thinking):
    extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    body = client.post("/tokenize", json={"messages": CONVERSATION, "tools": [WEATHER],
                                          "add_generation_prompt": add_generation_prompt, **extra}).json()
    want = hf_demo_tokenizer.apply_chat_template(
        CONVERSATION, tools=[WEATHER], add_generation_prompt=add_generation_prompt,
        **({} if thinking is None else {"enable_thinking": thinking}))["input_ids"]
    assert body["tokens"] == list(want) and body["count"] == len(want)


def test_detokenize_round_trip(client, hf_demo_tokenizer):
    ids = hf_demo_tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER], add_generation_prompt=True)["input_ids"]
    body = client.post("/detokenize", json={"model": "qwen3", "tokens": list(ids)}).json()
    assert body == {"prompt": hf_demo_tokenizer.decode(ids)}
    assert "<tool_call>" in body["prompt"] and "<|im_start|>" in body["prompt"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": ASK}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "tools": [WEATHER]}, "tools"),
    ("/tokenize", {"messages": ASK, "tools": [{"type": "function"}]}, "tools[0]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 7]}, None),
])
def test_bad_bodies_are_400(client, path, body, param):
    reply = client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": ASK}),
                                        ("/detokenize", {"tokens": [1, 2]})])
def test_an_unknown_model_is_not_found_as_the_generation_routes_answer(demo_tokenizer, path, body):
    client, tokenizer = routes(demo_tokenizer)
    error = error_of(client.post(path, json={"model": "gpt-4", **body}), 404)
    assert error == {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError", "param": "model",
                     "code": 404}
    assert tokenizer.called == []
    for model in ("qwen3", ""):  # the served name, or none: an empty name is the served model, as in vLLM
        assert client.post(path, json={"model": model, **body}).status_code == 200, model
    assert client.post(path, json=body).status_code == 200  # no model field at all


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "messages": ASK}, None),
    ({"prompt": ""}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": ASK, "tools": [{"type": "function"}]}, "tools[0]"),
])
def test_a_bad_tokenize_request_gets_400_while_no_worker_serves(demo_tokenizer, body, param):
    client, tokenizer = routes(demo_tokenizer, worker=False)
    error = error_of(client.post("/tokenize", json={"model": "qwen3", **body}), 400)
    assert error["param"] == param, error
    assert tokenizer.called == []
    # A valid one waits for a worker (its max_model_len is the worker's), and is not encoded meanwhile.
    error_of(client.post("/tokenize", json={"model": "qwen3", "prompt": "hi"}), 503)
    assert tokenizer.called == []
