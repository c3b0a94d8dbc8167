"""A prompt is encoded once for all its choices and repeats, and an oversized chat (tools counted) not at all."""
from __future__ import annotations

import json
import unicodedata

import pytest

from tests.unit.test_generation_core import TEXT
from tests.unit.test_http_app import error_of
from tests.unit.test_http_refusals import SERVED, served


@pytest.fixture()
def serve(demo_tokenizer):
    return lambda **options: served(demo_tokenizer, **options)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_n_choices_of_a_chat_share_one_encode(serve):
    client, downstreams, encodes = serve()
    reply = client.post("/v1/chat/completions", json={
        "model": SERVED, "messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 4, "seed": 1})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 4 and len(downstreams.works) == 4
    assert len(encodes) == 1
    # Every choice got the shared prompt's ids.
    expected = downstreams.tokenizer.core.encode("hi")
    assert all(list(work.prompt_token_ids) == expected for work in downstreams.works)


def test_each_distinct_prompt_is_encoded_once(serve):
    client, downstreams, encodes = serve()
    prompts = ["one", "two", "one", "three", "two"]
    reply = client.post("/v1/completions", json={"model": SERVED, "prompt": prompts, "n": 3, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 15
    assert sorted(e.text for e in encodes) == ["one", "three", "two"]
    core = downstreams.tokenizer.core
    # Each choice got its own prompt's ids (the worker streams open in whatever order the encodes end).
    assert sorted(list(w.prompt_token_ids) for w in downstreams.works) == sorted(
        core.encode(p) for p in prompts for _ in range(3))
    want = unicodedata.normalize("NFC", TEXT)
    assert all(c["text"] == want for c in reply.json()["choices"])


def test_a_chat_too_long_with_its_tools_is_refused_before_any_encode(serve):
    tools = [WEATHER] * 4
    tools_chars = sum(len(json.dumps(tool, ensure_ascii=False)) for tool in tools)
    client, downstreams, encodes = serve(overrides={"max_prompt_chars": tools_chars})
    body = {"model": SERVED, "messages": [{"role": "user", "content": "weather?"}], "tools": tools, "max_tokens": 4}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages" and str(tools_chars + len("weather?")) in error["message"]
    assert encodes == [] and downstreams.works == []
    # Past calls' arguments count too.
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"city": "x" * tools_chars})}}
    body = {"model": SERVED, "max_tokens": 4, "messages": [
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages" and encodes == [] and downstreams.works == []


def test_a_prompts_message_is_built_once_for_all_its_choices():
    """Choices of one prompt take the first's call without building (and serializing) the message again: for
    a megabyte-long prompt and n = 8 that was tens of milliseconds of the event loop."""
    import asyncio

    from gateway.core.generation import SharedEncodes
    from vllm_v0.tokenizer.v1 import tokenizer_pb2

    class Tokenizer:
        def __init__(self):
            self.calls = []

        async def Encode(self, request, timeout=None):
            self.calls.append(request.text)
            await asyncio.sleep(0)
            return tokenizer_pb2.EncodeResponse(token_ids=[len(request.text)])

    async def main():
        tokenizer, shared, builds = Tokenizer(), SharedEncodes(), []

        def build(text):
            def message():
                builds.append(text)
                return tokenizer_pb2.EncodeRequest(text=text)
            return message

        first, repeat = shared.prompt(), shared.prompt()
        replies = await asyncio.gather(*[first.encode(tokenizer, build("a" * 1000), None) for _ in range(8)],
                                       *[repeat.encode(tokenizer, build("a" * 1000), None) for _ in range(8)])
        return tokenizer.calls, builds, replies

    calls, builds, replies = asyncio.run(main())
    assert builds == ["a" * 1000] * 2  # once per prompt, not per choice
    assert calls == ["a" * 1000]  # the repeat found the first's call by its message
    assert all(list(r.token_ids) == [1000] for r in replies)
