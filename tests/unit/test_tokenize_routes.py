"""vLLM's /tokenize and /detokenize routes over the real tokenizer core, checked against transformers."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.http_api.http_app import create_app
from tests.unit.test_generation_core import FakeDownstreams
from tests.unit.test_tool_calls_api import ASK, WEATHER, RenderingTokenizer

CONVERSATION = [*ASK,
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_a", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}]


@pytest.fixture()
def client(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, [])
    downstreams.tokenizer = RenderingTokenizer(demo_tokenizer)
    return TestClient(create_app(GenerationCore(downstreams, {}), lambda: "qwen3", lambda: True, None, 1 << 20))


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
