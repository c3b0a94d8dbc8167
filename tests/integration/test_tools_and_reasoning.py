"""Tool calling, reasoning, /tokenize and /detokenize through the real three services.

Random weights never write a tool call, so the parsing itself is tested on scripted streams
(tests/unit/test_tool_calls_api.py); here the prompt is checked against transformers, and the
HTTP and gRPC paths against each other on the same greedy output.
"""
from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys
import urllib.request

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from vllm_v0.gateway.v1 import gateway_pb2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "12 C, rain"},
]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


@pytest.fixture()
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_tokenize_with_tools_equals_transformers_and_detokenize_inverts_it(stack, reference):
    _, tokenizer = reference
    want = tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER], add_generation_prompt=True,
                                         enable_thinking=False)["input_ids"]
    body = post(stack.http_url + "/tokenize", {
        "model": "", "messages": CONVERSATION, "tools": [WEATHER],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert body["tokens"] == list(want) and body["count"] == len(want) and body["max_model_len"] == 1024
    text = post(stack.http_url + "/detokenize", {"tokens": body["tokens"]})["prompt"]
    assert text == tokenizer.decode(want) and "<tools>\n{" in text and "<tool_response>\n12 C, rain" in text
    prompt = post(stack.http_url + "/tokenize", {"prompt": "Hello 世界"})
    assert prompt["tokens"] == tokenizer("Hello 世界")["input_ids"]


def test_chat_with_tools_over_http_and_grpc_agree(client, gateway, stack):
    counted = post(stack.http_url + "/tokenize", {"messages": CONVERSATION, "tools": [WEATHER]})["count"]
    whole = client.chat.completions.create(model="", messages=CONVERSATION, tools=[WEATHER], max_tokens=24,
                                           temperature=0)
    assert whole.usage.prompt_tokens == counted
    message = whole.choices[0].message
    replies = list(gateway.Generate(gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content=CONVERSATION[0]["content"]),
                  gateway_pb2.ChatMessage(role="assistant", tool_calls=[gateway_pb2.ToolCall(
                      id="call_a", name="get_weather", arguments='{"city": "Zürich"}')]),
                  gateway_pb2.ChatMessage(role="tool", tool_call_id="call_a", content="12 C, rain")],
        tools=[json.dumps(WEATHER)], max_tokens=24, temperature=0)))
    assert replies[-1].usage.prompt_tokens == counted
    assert "".join(r.text for r in replies) == (message.content or "")
    assert "".join(r.reasoning_text for r in replies) == (message.model_extra["reasoning_content"] or "")
    assert not any(r.tool_calls for r in replies) and message.tool_calls is None

    streamed = client.chat.completions.create(model="", messages=CONVERSATION, tools=[WEATHER], max_tokens=24,
                                              temperature=0, stream=True)
    chunks = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.content or "" for d in chunks) == (message.content or "")


BOUNDED = {"type": "function", "function": {"name": "pick_city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}}}


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def steered_to_think(checkpoint) -> dict:
    """Sampling that makes a random model think briefly and then end its think block: +100 on <think> opens it,
    each further <think> costs 2 (frequency) on top of 2 (presence), so after about ten </think> (+80) wins.
    Thinking on, nothing in the prompt closes the block: without the model's </think> no constraint starts."""
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return {"logit_bias": {str(tokenizer.token_to_id("<think>")): 100, str(tokenizer.token_to_id("</think>")): 80},
            "frequency_penalty": 2.0, "presence_penalty": 2.0}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_forced_tool_choice_always_returns_a_call_whose_arguments_validate(client, checkpoint, seed, parallel,
                                                                             thinking):
    """Random weights never write a tool call unaided: with a named function the worker's grammar makes exactly
    one, and ends the output there, whether or not parallel calls are allowed. Thinking on (Qwen3's default),
    the model reasons first and the grammar starts after its </think>, as vLLM's does with a reasoning parser."""
    steering = steered_to_think(checkpoint) if thinking else {"extra_body": NO_THINKING}
    reply = client.chat.completions.create(model="", messages=CONVERSATION[:1], tools=[WEATHER, BOUNDED],
                                           tool_choice={"type": "function", "function": {"name": "pick_city"}},
                                           parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                                           max_tokens=200, **steering)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "pick_city"
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED["function"]["parameters"])
    # The grammar ended the output, not a stop token; the think block is reasoning, and no part of it content.
    assert choice.model_extra["stop_reason"] is None and choice.message.content is None
    assert bool(choice.message.model_extra.get("reasoning_content")) == thinking


@pytest.mark.parametrize("thinking", [True, False])
def test_a_forced_tool_choice_over_grpc_with_thinking_on_and_off(gateway, checkpoint, thinking):
    steering = steered_to_think(checkpoint)
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(**CONVERSATION[0])], tools=[json.dumps(WEATHER), json.dumps(BOUNDED)],
        tool_choice="pick_city", temperature=1.0, seed=4, max_tokens=200)
    if thinking:
        request.logit_bias.update({int(k): v for k, v in steering["logit_bias"].items()})
        request.frequency_penalty, request.presence_penalty = 2.0, 2.0
    else:
        request.enable_thinking = False
    replies = list(gateway.Generate(request, timeout=120))
    calls: dict[str, dict] = {}
    for piece in (c for r in replies for c in r.tool_calls):
        call = calls.setdefault(piece.id, {"name": piece.name, "arguments": ""})
        call["arguments"] += piece.arguments
    assert [c["name"] for c in calls.values()] == ["pick_city"]
    jsonschema.validate(json.loads(next(iter(calls.values()))["arguments"]), BOUNDED["function"]["parameters"])
    assert bool("".join(r.reasoning_text for r in replies)) == thinking
    assert "".join(r.text for r in replies).strip() == ""
    assert (replies[-1].finish_reason, replies[-1].stop_reason) == (gateway_pb2.FINISH_REASON_EOS, "")


def readme_grpcurl_commands_with(word: str) -> list[list[str]]:
    """The README's grpcurl commands that mention `word`, as argument lists (continuation lines joined)."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    commands, current = [], ""
    for line in readme.splitlines():
        if line.startswith(".venv/bin/grpcurl ") or current:
            current += line + "\n"
            # A command ends where its quotes are balanced and no backslash continues it.
            if current.count("'") % 2 == 0 and not line.endswith("\\"):
                commands.append(shlex.split(current.replace("\\\n", " ")))
                current = ""
    return [c for c in commands if word in " ".join(c)]


def test_readme_grpcurl_tool_examples_run(stack):
    grpcurl = str(pathlib.Path(sys.executable).parent / "grpcurl")
    commands = readme_grpcurl_commands_with("tool")
    assert len(commands) == 2
    for command in commands:
        args = [stack.gateway.address if a == "localhost:50051" else a for a in command[1:]]
        result = subprocess.run([grpcurl, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert '"finish_reason"' in result.stdout  # the stream ran to its last message
