"""Tool calls and reasoning over HTTP (the real `openai` client) and gRPC Generate, on a scripted worker stream.

The tokenizer side is the real one (the demo checkpoint's template, in Qwen3's conversation format,
through the tokenizer servicer), so the prompt the worker gets is checked against transformers; the
worker replays scripted text, as random weights would never write a tool call.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json

import grpc
import openai
import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.grpc_api.servicer import GatewayServicer
from gateway.http_api.http_app import create_app
from services.tokenizer.chat_template import ChatTemplate
from services.tokenizer.servicer import TokenizerServicer
from tests.unit.test_generation_core import IM_END, FakeDownstreams, FakeTokenizer
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris and Zürich?"}]
THINKING = "<think>\nThe user wants the weather — twice. 🌦\n</think>\n\n"
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')


class CallContext:
    """The part of a servicer context an error uses: it ends the call as the client's stub would see it."""

    async def abort(self, code, details):
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RenderingTokenizer(FakeTokenizer):
    """Encode and Decode as the tokenizer service answers them, template and all."""

    async def Encode(self, request, timeout=None):
        return await TokenizerServicer(self.core).Encode(request, CallContext())

    async def Decode(self, request, timeout=None):
        return await TokenizerServicer(self.core).Decode(request, CallContext())


@pytest.fixture()
def serve(demo_tokenizer):
    """serve(script) -> (openai client, downstreams) whose worker writes `script`, then <|im_end|>."""
    def make(script: str, finish=worker_pb2.FINISH_REASON_EOS):
        ids = [*demo_tokenizer.encode(script), IM_END] if finish == worker_pb2.FINISH_REASON_EOS else \
            demo_tokenizer.encode(script)
        downstreams = FakeDownstreams(demo_tokenizer, ids, finish)
        # As the tokenizer's GetInfo lists them: the special tokens, </think> among them.
        think_end = demo_tokenizer.tokenizer.token_to_id("</think>")
        downstreams.token_text = {**downstreams.token_text, think_end: "</think>"}
        downstreams.tokenizer = RenderingTokenizer(demo_tokenizer)
        downstreams.detokenizer.tokenizer = downstreams.tokenizer
        app = create_app(GenerationCore(downstreams, {}), lambda: "qwen3", lambda: True, None, 1 << 20)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                               http_client=TestClient(app))
        return client, downstreams
    return make


def streamed(client, **kwargs):
    """A streamed chat reassembled as an OpenAI client does: (content, reasoning, calls, finish, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, 0
    for chunk in client.chat.completions.create(model="qwen3", stream=True, **kwargs):
        chunks += 1
        delta = chunk.choices[0].delta
        # A character split across tokens is held back whole, in reasoning as in content.
        assert "\ufffd" not in (delta.content or "") + ((delta.model_extra or {}).get("reasoning_content") or "")
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                # The first piece of a call carries its id and whole name, before any argument text.
                assert piece.id.startswith("call_") and piece.function.name and piece.type == "function"
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": "", "pieces": 0}
            else:
                assert piece.id is None and not piece.function.name
            calls[piece.index]["arguments"] += piece.function.arguments or ""
            calls[piece.index]["pieces"] += 1
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, chunks


def test_tool_calls_streamed_reassemble_to_the_whole_response(serve):
    client, downstreams = serve(THINKING + CALLS)
    kwargs = dict(messages=ASK, tools=[WEATHER, CLOCK], temperature=0)
    whole = client.chat.completions.create(model="qwen3", **kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "\nThe user wants the weather — twice. 🌦\n"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Zürich"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls) and calls[0].id != calls[1].id

    content, reasoning, stream_calls, finish, _ = streamed(client, **kwargs)
    assert (content, reasoning, finish) == ("", choice.message.model_extra["reasoning_content"], "tool_calls")
    assert [(c["name"], c["arguments"]) for c in stream_calls] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(c["pieces"] > 2 for c in stream_calls)  # arguments arrive in pieces, as the tokens come


def test_text_around_calls_stays_content_and_parallel_false_keeps_one_call(serve):
    client, _ = serve("Let me check both.\n" + CALLS)
    kwargs = dict(messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    whole = client.chat.completions.create(model="qwen3", **kwargs).choices[0]
    assert whole.message.content == "Let me check both." and whole.message.model_extra["reasoning_content"] is None
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == [{"city": "Paris", "days": 2}]
    content, reasoning, calls, finish, _ = streamed(client, **kwargs)
    assert (content, reasoning, finish, len(calls)) == ("Let me check both.", "", "tool_calls", 1)


def test_prompt_with_tools_and_past_calls_matches_transformers(serve, hf_demo_tokenizer):
    client, downstreams = serve("It is 18 C in Paris.")
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_b", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
                {"role": "tool", "tool_call_id": "call_b", "content": "12 C"}]
    reply = client.chat.completions.create(model="qwen3", messages=messages, tools=[WEATHER, CLOCK])
    # transformers sees the assistant turn as the template does: content "" rather than absent.
    expected_messages = [{**m, "content": m["content"] or ""} for m in messages]
    expected = hf_demo_tokenizer.apply_chat_template(expected_messages, tools=[WEATHER, CLOCK], tokenize=True,
                                                     add_generation_prompt=True)["input_ids"]
    assert list(downstreams.works[0].prompt_token_ids) == list(expected)
    assert reply.choices[0].message.content == "It is 18 C in Paris." and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None


def test_tool_choice_none_offers_no_tools_and_parses_nothing(serve, demo_tokenizer):
    client, downstreams = serve(CALLS)
    reply = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in demo_tokenizer.decode(list(downstreams.works[0].prompt_token_ids))
    assert reply.choices[0].message.content == CALLS and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_thinking_off_gives_no_reasoning_and_stop_strings_still_apply(serve):
    client, downstreams = serve("Plain answer. Zürich then more")
    reply = client.chat.completions.create(model="qwen3", messages=ASK, stop=["then"],
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == "Plain answer. Zürich "
    assert reply.choices[0].message.model_extra["reasoning_content"] is None
    content, reasoning, _, finish, _ = streamed(client, messages=ASK, stop=["then"],
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (content, reasoning, finish) == ("Plain answer. Zürich ", "", "stop")


def test_reasoning_streams_as_its_own_deltas(serve):
    client, _ = serve(THINKING + "Sunny. ☀️")
    content, reasoning, calls, finish, chunks = streamed(client, messages=ASK)
    assert (content, reasoning, calls, finish) == ("\n\nSunny. ☀️", "\nThe user wants the weather — twice. 🌦\n",
                                                   [], "stop")
    whole = client.chat.completions.create(model="qwen3", messages=ASK).choices[0].message
    assert (whole.content, whole.model_extra["reasoning_content"]) == (content, reasoning)


def test_a_stop_string_inside_the_reasoning_ends_it_there(serve):
    client, downstreams = serve(THINKING + CALLS)
    kwargs = dict(messages=ASK, tools=[WEATHER], stop=["twice"])
    whole = client.chat.completions.create(model="qwen3", **kwargs).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None and whole.message.content == ""
    assert whole.message.model_extra["reasoning_content"] == "\nThe user wants the weather — "
    content, reasoning, calls, finish, _ = streamed(client, **kwargs)
    assert (content, reasoning, calls, finish) == ("", "\nThe user wants the weather — ", [], "stop")
    assert all(stream.cancelled for stream in downstreams.streams)  # the worker stopped at the stop string


def test_reasoning_cut_by_max_tokens_stays_reasoning(serve):
    client, _ = serve(THINKING, finish=worker_pb2.FINISH_REASON_LENGTH)
    whole = client.chat.completions.create(model="qwen3", messages=ASK).choices[0]
    assert whole.finish_reason == "length" and whole.message.content == "\n\n"


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "already constrains"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
])
def test_bad_tool_requests_are_refused(serve, extra, param, words):
    client, downstreams = serve("x")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="qwen3", messages=ASK, **extra)
    assert error.value.body["param"] == param and words in error.value.body["message"]
    assert downstreams.works == []


@contextlib.asynccontextmanager
async def gateway_stub(downstreams):
    """A GatewayService stub on a gateway servicer served on port 0 over these downstreams; the client keeps
    gRPC's defaults (a 4 MiB receive limit among them)."""
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayServicer(GenerationCore(downstreams, {}), "qwen3"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GatewayServiceStub(channel)
    finally:
        await downstreams.detokenizer.close()
        await server.stop(None)


def generate(downstreams, request: gateway_pb2.GenerateRequest,
             timeout: float | None = None) -> list[gateway_pb2.GenerateResponse]:
    """The replies of a public Generate call to a gateway servicer on port 0."""
    async def run():
        async with gateway_stub(downstreams) as stub:
            return [r async for r in stub.Generate(request)]
    return asyncio.run(asyncio.wait_for(run(), timeout))


def test_grpc_generate_parses_reasoning_and_tool_calls_like_http(serve, hf_demo_tokenizer):
    client, downstreams = serve(THINKING + CALLS)
    past_call = gateway_pb2.ToolCall(id="call_a", name="get_weather", arguments='{"city": "Oslo"}')
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="Oslo?"),
                  gateway_pb2.ChatMessage(role="assistant", tool_calls=[past_call]),
                  gateway_pb2.ChatMessage(role="tool", tool_call_id="call_a", content="3 C"),
                  gateway_pb2.ChatMessage(**ASK[0])],
        tools=[json.dumps(WEATHER)])
    replies = generate(downstreams, request)
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_a", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": "3 C"}, ASK[0]]
    expected = hf_demo_tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True)["input_ids"]
    assert list(downstreams.works[0].prompt_token_ids) == list(expected)

    assert "".join(r.text for r in replies) == ""
    assert "".join(r.reasoning_text for r in replies) == "\nThe user wants the weather — twice. 🌦\n"
    calls: dict[str, dict] = {}
    for piece in (c for r in replies for c in r.tool_calls):
        call = calls.setdefault(piece.id, {"name": piece.name, "arguments": ""})
        assert piece.name in ("", call["name"])
        call["arguments"] += piece.arguments
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Zürich"})]
    assert all(i.startswith("call_") for i in calls)
    assert replies[-1].finish_reason == gateway_pb2.FINISH_REASON_EOS

    # The same output over HTTP gives the same calls.
    http = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER]).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in http.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls.values()]


def test_grpc_parallel_tool_calls_false_and_forced_choice(serve):
    _, downstreams = serve(CALLS)
    replies = generate(downstreams, gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(**ASK[0])], tools=[json.dumps(WEATHER)], parallel_tool_calls=False))
    assert len({c.id for r in replies for c in r.tool_calls}) == 1
    generate(downstreams, gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(**ASK[0])], tools=[json.dumps(WEATHER), json.dumps(CLOCK)],
        tool_choice="get_weather"))
    grammar = downstreams.works[-1].structured_output.grammar
    assert '"const": "get_weather"' in grammar and '"now"' not in grammar


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("choice, names, parallel", [
    ("required", ["get_weather", "now"], True),
    ({"type": "function", "function": {"name": "now"}}, ["now"], True),
    ("required", ["get_weather", "now"], False),
])
def test_a_forced_tool_choice_constrains_the_worker_to_calls_of_the_allowed_tools(serve, demo_tokenizer, choice,
                                                                                   names, parallel, thinking):
    """The worker gets a grammar of `<tool_call>` blocks over the allowed tools' schemas; the answer is parsed as
    with "auto". Thinking on (Qwen3's default), the prompt leaves the think block to the model and the grammar
    starts after its `</think>`, as vLLM's does with a reasoning parser; off, it holds from the first token."""
    client, downstreams = serve(CALLS)
    extra = {} if thinking is None else {"extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}}
    message = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                                             parallel_tool_calls=parallel, **extra).choices[0].message
    work = downstreams.works[-1]
    grammar = work.structured_output.grammar
    # Only "required" with parallel calls lets the grammar go on after a call; a named function is called once.
    many = parallel and choice == "required"
    # After </think> Qwen3 writes a blank line before its answer: the grammar lets it.
    blank = "BLANK? " if thinking is not False else ""
    assert grammar.startswith(f"start: {blank}call (\"\\n\" call)*\n" if many else f"start: {blank}call\n")
    assert sorted(n for n in ("get_weather", "now") if f'"const": "{n}"' in grammar) == names
    assert json.dumps(WEATHER["function"]["parameters"]) in grammar or names == ["now"]
    prompt = demo_tokenizer.decode(list(work.prompt_token_ids))
    if thinking is False:
        assert prompt.endswith("<think>\n\n</think>\n\n")
        assert not work.structured_output.HasField("start_after_token_id")
    else:
        assert prompt.endswith("<|im_start|>assistant\n")
        assert work.structured_output.start_after_token_id == demo_tokenizer.tokenizer.token_to_id("</think>")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] * (2 if parallel else 1)


def test_reasoning_when_the_template_opens_the_think_block(serve, demo_tokenizer, demo_tokenizer_dir):
    """Templates such as Qwen3-2507 Thinking's end the prompt with `<think>\\n`: the output starts inside it."""
    config = json.loads((demo_tokenizer_dir / "tokenizer_config.json").read_text())
    opens = "{%- if add_generation_prompt %}\n    {{- open_turn('assistant')"
    source = config["chat_template"].replace(opens, opens + " + '<think>\\n'")
    assert source != config["chat_template"]
    opening = copy.copy(demo_tokenizer)
    opening.chat_template = ChatTemplate(source, config)
    client, downstreams = serve("Cold up north.\n</think>\n\nTake a coat. </think>")
    downstreams.tokenizer = RenderingTokenizer(opening)
    downstreams.detokenizer.tokenizer = downstreams.tokenizer
    whole = client.chat.completions.create(model="qwen3", messages=ASK).choices[0].message
    assert (whole.model_extra["reasoning_content"], whole.content) == ("Cold up north.\n", "\n\nTake a coat. </think>")
    assert opening.decode(list(downstreams.works[0].prompt_token_ids)).endswith("<|im_start|>assistant\n<think>\n")
    content, reasoning, _, _, _ = streamed(client, messages=ASK)
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)


@pytest.mark.parametrize("thinking, starts_after", [(None, True), (True, True), (False, False)])
def test_a_chats_structured_output_starts_after_the_reasoning(serve, demo_tokenizer, thinking, starts_after):
    """As in vLLM: with thinking on, the worker's constraint waits for </think>; off, it holds from the start."""
    client, downstreams = serve("{}")
    think_end = demo_tokenizer.tokenizer.token_to_id("</think>")
    downstreams.token_text = {**downstreams.token_text, think_end: "</think>"}
    extra = {} if thinking is None else {"extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}}
    client.chat.completions.create(model="qwen3", messages=ASK, response_format={"type": "json_object"}, **extra)
    constraint = downstreams.works[-1].structured_output
    assert constraint.json_object
    assert constraint.HasField("start_after_token_id") == starts_after
    if starts_after:
        assert constraint.start_after_token_id == think_end
    # A completion prompt has no reasoning parser: its constraint holds from the first token.
    client.completions.create(model="qwen3", prompt="{", extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    assert not downstreams.works[-1].structured_output.HasField("start_after_token_id")


def grammar_bound(downstreams, demo_tokenizer_dir, script: str):
    """The worker as its structured-output engine runs it: the model would write `script`; with a grammar,
    it writes the tokens the grammar takes, and the sequence ends (an "eos") where the grammar is complete."""
    import llguidance
    from tokenizers import Tokenizer

    path = demo_tokenizer_dir / "tokenizer.json"
    encoder = Tokenizer.from_file(str(path))
    eos = [encoder.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=encoder.get_vocab_size(), eos_token=eos)
    wanted = downstreams.ids

    def open_worker_stream(work, timeout):
        downstreams.ids = wanted
        if work.HasField("structured_output"):
            constraint = work.structured_output
            free = 0  # as the worker's grammar state: nothing is matched until start_after_token_id is generated
            if constraint.HasField("start_after_token_id"):
                assert constraint.start_after_token_id in wanted, script
                free = wanted.index(constraint.start_after_token_id) + 1
            matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
            assert not matcher.get_error(), matcher.get_error()
            taken = matcher.validate_tokens(wanted[free:])
            assert matcher.consume_tokens(wanted[free:free + taken]) and matcher.is_stopped(), script
            downstreams.ids = wanted[:free + taken]
        return FakeDownstreams.open_worker_stream(downstreams, work, timeout)
    downstreams.open_worker_stream = open_worker_stream


COMPACT_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("choice, parallel, calls", [
    ({"type": "function", "function": {"name": "get_weather"}}, True, 1),
    ({"type": "function", "function": {"name": "get_weather"}}, False, 1),
    ("required", False, 1),
    ("required", True, 5),  # "required" with parallel calls: as many as the model writes
])
def test_a_forced_tool_choice_returns_its_calls_and_ends(serve, demo_tokenizer_dir, choice, parallel, calls, thinking):
    """A model that would call the tool again and again: the grammar ends the output after the forced calls.
    Thinking on, the model reasons first, unconstrained, and the calls follow its `</think>`."""
    script = (THINKING if thinking else "") + "\n".join([COMPACT_CALL] * 5)
    client, downstreams = serve(script)
    grammar_bound(downstreams, demo_tokenizer_dir, script)
    kwargs = dict(messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=parallel,
                  extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    reasoning = "\nThe user wants the weather — twice. 🌦\n" if thinking else None
    whole = client.chat.completions.create(model="qwen3", **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.model_extra["reasoning_content"] == reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})] * calls
    # The grammar ended the output, not a stop token: there is no stop reason to give.
    assert whole.model_extra["stop_reason"] is None
    content, streamed_reasoning, stream_calls, finish, _ = streamed(client, **kwargs)
    assert (content, streamed_reasoning, finish, len(stream_calls)) == ("", reasoning or "", "tool_calls", calls)


def test_a_forced_call_over_grpc_ends_with_no_stop_reason(serve, demo_tokenizer_dir):
    script = THINKING + "\n".join([COMPACT_CALL] * 2)
    _, downstreams = serve(script)
    grammar_bound(downstreams, demo_tokenizer_dir, script)
    replies = generate(downstreams, gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(**ASK[0])], tools=[json.dumps(WEATHER)], tool_choice="get_weather"))
    assert "".join(r.reasoning_text for r in replies) == "\nThe user wants the weather — twice. 🌦\n"
    assert [c.name for r in replies for c in r.tool_calls if c.name] == ["get_weather"]
    assert (replies[-1].finish_reason, replies[-1].stop_reason) == (gateway_pb2.FINISH_REASON_EOS, "")


def test_a_call_cut_off_by_max_tokens_is_content_in_a_whole_response(serve):
    """As vLLM: a whole response gives a call that never ended as content; a stream has sent its pieces as they
    came. Either way finish_reason is "length"."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    client, _ = serve(CALLS.split("\n<tool_call>")[0] + "\n" + cut, finish=worker_pb2.FINISH_REASON_LENGTH)
    whole = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER]).choices[0]
    assert whole.finish_reason == "length" and whole.message.content == cut
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == [{"city": "Paris", "days": 2}]
    content, _, calls, finish, _ = streamed(client, messages=ASK, tools=[WEATHER])
    assert (content, finish) == ("", "length") and [c["name"] for c in calls] == ["get_weather"] * 2


def test_a_call_cut_off_by_max_tokens_sends_no_empty_piece_over_grpc(serve):
    """gRPC streams as HTTP does: the cut call's pieces went out as they came, and LENGTH says it is cut."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    _, downstreams = serve(CALLS.split("\n<tool_call>")[0] + "\n" + cut, finish=worker_pb2.FINISH_REASON_LENGTH)
    replies = generate(downstreams, gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(**ASK[0])],
                                                                tools=[json.dumps(WEATHER)]))
    pieces = [c for r in replies for c in r.tool_calls]
    assert all(c.name or c.arguments for c in pieces), pieces
    assert [c.name for c in pieces if c.name] == ["get_weather"] * 2 and len({c.id for c in pieces}) == 2
    arguments = "".join(c.arguments for c in pieces if c.id == pieces[-1].id)
    assert arguments == '{"city": "Pa' and replies[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get\\q", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get\x01", "arguments": {}}\n</tool_call>',
    "<tool_call>" + "[" * 5000 + "</tool_call>",
])
def test_tool_call_text_the_parser_cannot_read_is_content(serve, bad):
    client, _ = serve(bad + "\n" + CALLS)
    whole = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER]).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == bad
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == [
        {"city": "Paris", "days": 2}, {"city": "Zürich"}]
    content, _, calls, finish, _ = streamed(client, messages=ASK, tools=[WEATHER])
    assert (content, finish, [c["name"] for c in calls]) == (bad, "tool_calls", ["get_weather"] * 2)
    # The calls are numbered from 0, the bad block not counted.
    indexes = [piece.index for chunk in client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER],
                                                                         stream=True)
               for piece in chunk.choices[0].delta.tool_calls or []]
    assert sorted(set(indexes)) == [0, 1] and indexes == sorted(indexes)


def test_a_forced_call_cut_off_by_max_tokens_is_dropped_not_content(serve):
    """Under a forced tool choice the output was to be calls alone: half a call is neither a call nor content."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    client, _ = serve(CALLS.split("\n<tool_call>")[0] + "\n" + cut, finish=worker_pb2.FINISH_REASON_LENGTH)
    whole = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris", "days": 2}]
