"""The hostile requests bench.adversarial sends: what a hostile client or a confused model produces.

Each attack builds one request from a seeded random generator, over gRPC (a GenerateRequest) or
HTTP (a JSON body for the named route, or raw bytes). A body's empty "model" is the served one. Sizes are picked so each stays within the
tiny demo checkpoint's 4096-token context, yet is far past where a parser that backtracks or
rescans, or a compiler without bounds, shows it.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from vllm_v0.gateway.v1 import gateway_pb2


@dataclass(frozen=True)
class Served:
    """What the attacks need of the served model: its name, and the token ids the steering attacks bias."""
    model: str
    space: int
    tool_call: int
    think: int
    think_end: int
    bracket: int


@dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[random.Random, Served], object]  # a GenerateRequest, a JSON body, or raw bytes
    http_path: str | None = None                      # None: the gateway's gRPC Generate


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def deep_object(depth: int) -> str:
    """A schema nested `depth` objects deep, as text: Python's own json module cannot write one this deep."""
    return '{"type": "object", "required": ["a"], "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def deep_array(depth: int) -> str:
    return '{"type": "array", "minItems": 1, "items": ' * depth + '{"type": "integer"}' + "}" * depth


def hostile_schema(rng: random.Random) -> str:
    """A schema as JSON text: deep, wide, self-referring, with a hostile pattern, or impossible."""
    kind = rng.randrange(7)
    if kind == 0:
        return deep_object(rng.choice([70, 300, 3000]))
    if kind == 1:
        return deep_array(rng.choice([70, 500, 3000]))
    if kind == 2:  # wide: every property required
        n = rng.choice([2000, 20000])
        return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                           "required": [f"p{i}" for i in range(n)]})
    if kind == 3:
        return json.dumps({"enum": [f"value-{i}-{'x' * 20}" for i in range(rng.choice([5000, 50000]))]})
    if kind == 4:  # a reference to itself, with nothing to end it
        return json.dumps({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                           "required": ["next"]}}, "$ref": "#/$defs/n"})
    if kind == 5:
        return json.dumps({"type": "string", "pattern": rng.choice(HOSTILE_REGEXES)})
    return json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "minProperties": 10**9})


HOSTILE_REGEXES = [
    "(a*)*b", "(a|aa)*c", "(x+x+)+y", "((((((a)*)*)*)*)*)*", "a{100000}", "[^\\n]{0,1000000}", "(a{1000}){1000}",
    "(" * 3000 + "a" + ")" * 3000, "\\p{NoSuchClass}", "(", "a{2,1}", "[z-a]", "(?<=a)b",
]


def hostile_grammar(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:  # a chain of rules deeper than any stack
        n = rng.choice([500, 5000])
        return "start: r0\n" + "".join(f'r{i}: "(" r{i + 1} ")"\n' for i in range(n)) + f'r{n}: "x"\n'
    if kind == 1:
        return 'start: start "a" | "a"\n'
    if kind == 2:  # a huge alternation
        return "start: " + " | ".join(f'"w{i}"' for i in range(rng.choice([5000, 50000]))) + "\n"
    if kind == 3:
        return "start: ("
    if kind == 4:
        return "root ::= root\n"
    return 'root ::= "a" root | "' + "b" * 100000 + '"\n'


def ask(**fields) -> gateway_pb2.GenerateRequest:
    """ASK as a gRPC chat request."""
    return gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(**ASK[0])], **fields)


def with_output(rng: random.Random) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="Answer in JSON:", max_tokens=rng.choice([8, 64]), temperature=0)


def grpc_schema(rng, served):
    req = with_output(rng)
    req.structured_output.json_schema = hostile_schema(rng)
    return req


def grpc_regex(rng, served):
    req = with_output(rng)
    req.structured_output.regex = rng.choice(HOSTILE_REGEXES)
    return req


def grpc_grammar(rng, served):
    req = with_output(rng)
    req.structured_output.grammar = hostile_grammar(rng)
    return req


def grpc_choice(rng, served):
    req = with_output(rng)
    req.structured_output.choice.choices.extend(rng.choice([[""], [f"c{i}" for i in range(100000)], ["x" * 10**6]]))
    return req


def http_schema(rng, served):
    """Chat with a deep or wide schema, through each way a schema arrives; thinking as the client chose."""
    schema = hostile_schema(rng)
    body = {"model": "", "messages": ASK, "max_tokens": 32}
    way = rng.randrange(3)
    if way == 0:  # an object in the body: as deep as Python's json module can still write
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": json.loads(deep_object(rng.choice([70, 250])))}}
    elif way == 1:
        body["structured_outputs"] = {"json": schema}
    else:
        body["guided_json"] = schema
    if rng.random() < 0.5:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def hostile_tools(rng: random.Random) -> list:
    kind = rng.randrange(6)
    if kind == 0:
        return [{"type": "function", "function": {"name": "deep", "parameters": json.loads(deep_object(70))}}]
    if kind == 1:
        return [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 50,
                                                  "parameters": WEATHER["function"]["parameters"]}}
                for i in range(rng.choice([500, 5000]))]
    if kind == 2:
        return [{"type": "function", "function": {"name": "bad", "parameters": "not a schema"}}]
    if kind == 3:
        return [{"type": "function", "function": {"name": "n" * 100000}}]
    if kind == 4:
        return [{"type": "function", "function": {"name": "p", "parameters": {"type": "string",
                                                                              "pattern": "(a*)*b"}}}]
    return [{"type": "function"}, {"function": None}, 7]


def http_tools(rng, served):
    tools = hostile_tools(rng)
    choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "get_weather"}},
                         {"type": "function", "function": {"name": "deep"}}])
    return {"model": "", "messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 32}


def grpc_tools(rng, served):
    req = ask(max_tokens=32, temperature=0)
    tools = hostile_tools(rng)
    req.tools.extend([json.dumps(t) for t in tools] if rng.random() < 0.8 else ["{not json", "[" * 5000])
    req.tool_choice = rng.choice(["auto", "required", "get_weather", "none", "x" * 1000])
    return req


def lark_text(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def forced_call_grammar(rng: random.Random) -> str:
    """A Lark grammar whose one sentence is call text that breaks a naive tool-call parser.

    `<tool_call>` is Qwen3's own token, named as one (unquoted): the model writes it as that token."""
    call = "start: <tool_call> "
    kind = rng.randrange(6)
    if kind == 0:  # a whitespace run then another character, inside the arguments
        return (call + lark_text('\n{"name": "get_weather", "arguments": {"city": "x",') + " SPACES "
                + lark_text('z"}}\n') + " </tool_call>\nSPACES: / {1500}/\n")
    if kind == 1:  # a name that never ends
        return call + lark_text('\n{"name": "') + " NAME\nNAME: /a{2500}/\n"
    if kind == 2:  # an invalid escape in the name
        return call + lark_text('\n{"name": "get\\q", "arguments": {}}\n') + " </tool_call>\n"
    if kind == 3:  # a raw control character in the name
        return call + lark_text('\n{"name": "get') + " CONTROL " + lark_text('weather", "arguments": {}}\n') \
            + " </tool_call>\nCONTROL: /\\x01/\n"
    if kind == 4:  # brackets deeper than Python's recursion limit
        return call + lark_text("\n") + " BRACKETS\nBRACKETS: /\\[{2500}/\n"
    return "start: opened{300}\nopened: <tool_call> " + lark_text("\n") + "\n"  # unterminated calls in a row


def steered_by_grammar(rng, served):
    """Tools offered, and the output forced by a grammar into text that breaks naive parsers."""
    req = ask(max_tokens=3000, temperature=0, enable_thinking=False)
    req.tools.append(json.dumps(WEATHER))
    req.structured_output.grammar = forced_call_grammar(rng)
    req.logit_bias[served.space] = 100.0  # where the grammar allows any amount of it, the longest whitespace run
    return req


def steered_by_bias(rng, served):
    """logit_bias alone drives the model into runs of whitespace, call tags or thinking tags."""
    token = rng.choice([served.space, served.tool_call, served.think, served.think_end, served.bracket])
    req = ask(max_tokens=rng.choice([500, 2000]), temperature=0)
    if rng.random() < 0.5:
        req.enable_thinking = False
    if rng.random() < 0.7:
        req.tools.append(json.dumps(WEATHER))
        req.tool_choice = rng.choice(["auto", "required", "get_weather"])
    req.logit_bias[token] = 100.0
    return req


def http_steered_call(rng, served):
    """A named tool choice with whitespace favoured: the forced call's arguments fill with it."""
    return {"model": "", "messages": ASK, "tools": [WEATHER], "max_tokens": 1500, "temperature": 0,
            "tool_choice": rng.choice([{"type": "function", "function": {"name": "get_weather"}}, "required"]),
            "logit_bias": {str(served.space): 100}, "stream": rng.random() < 0.5}


def long_prompts(rng, served):
    """Prompts at and past the limits: prompt logprobs over a long prompt, a megabyte of CJK, many prompts."""
    kind = rng.randrange(5)
    if kind == 0:
        req = gateway_pb2.GenerateRequest(prompt="word " * 3500, max_tokens=1, prompt_logprobs=20)
        return req
    if kind == 1:
        return gateway_pb2.GenerateRequest(prompt="你好世界" * 250000, max_tokens=1)
    if kind == 2:
        return gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="字" * 10**6)],
                                           max_tokens=1)
    if kind == 3:
        return gateway_pb2.GenerateRequest(prompt="x", max_tokens=1, stop=["s" * 10**5] * 30)
    return gateway_pb2.GenerateRequest(prompt="word " * 3500, max_tokens=4096)


def http_long(rng, served):
    kind = rng.randrange(3)
    if kind == 0:  # what lm-eval sends for loglikelihood, on a long prompt
        return {"model": "", "prompt": "word " * 3500, "max_tokens": 1, "echo": True, "logprobs": 5}
    if kind == 1:
        return {"model": "", "prompt": ["hello " * 500] * 256, "max_tokens": 1, "n": 1}
    return {"model": "", "prompt": "你好" * 400000, "max_tokens": 1, "n": 8}


def http_long_chat(rng, served):
    """A megabyte of chat text, alone or beside many tools, past the character limit once tools count."""
    content = "x" * rng.choice([10**6, 990_000])
    return {"model": "", "messages": [{"role": "user", "content": content}], "tools": [WEATHER] * 200,
            "max_tokens": 1, "n": rng.choice([1, 4])}


def http_invalid(rng, served):
    """Invalid on its face: answered 400 (or 404) at once, worker or no worker."""
    base = {"model": "", "messages": ASK, "max_tokens": 8}
    return {**base, **rng.choice([{"top_p": 2}, {"seed": -1}, {"messages": []}, {"model": "no-such-model"},
                                  {"top_logprobs": 50, "logprobs": True}, {"n": 0}, {"max_tokens": -1},
                                  {"temperature": "NaN"}, {"logit_bias": {"x": 1}}, {"stop": ["s"] * 10000},
                                  {"messages": [{"role": "wizard", "content": "x"}]},
                                  {"chat_template_kwargs": {"enable_thinking": "maybe"}}])}


def http_completion_invalid(rng, served):
    base = {"model": "", "prompt": "hello", "max_tokens": 8}
    return {**base, **rng.choice([{"prompt": ""}, {"prompt": []}, {"model": "gpt-4"}, {"logprobs": 50},
                                  {"prompt": [[]]}, {"prompt": [10**9]}, {"echo": True, "max_tokens": 0}])}


def deep_body(rng, served):
    """A JSON body nested past any parser's recursion limit."""
    depth = rng.choice([10000, 100000])
    return (b'{"model": "", "max_tokens": 1, "messages": ' + b"[" * depth + b"]" * depth + b"}")


def grpc_invalid(rng, served):
    return rng.choice([gateway_pb2.GenerateRequest(), gateway_pb2.GenerateRequest(prompt="x", top_p=2),
                       gateway_pb2.GenerateRequest(prompt="x", temperature=float("nan")),
                       gateway_pb2.GenerateRequest(prompt="x", logprobs=50),
                       gateway_pb2.GenerateRequest(prompt="x", logit_bias={10**9: 1.0})])


ATTACKS = [
    Attack("grpc_schema", grpc_schema),
    Attack("http_schema", http_schema, "/v1/chat/completions"),
    Attack("steered_by_grammar", steered_by_grammar),
    Attack("grpc_regex", grpc_regex),
    Attack("http_tools", http_tools, "/v1/chat/completions"),
    Attack("steered_by_bias", steered_by_bias),
    Attack("grpc_grammar", grpc_grammar),
    Attack("http_invalid", http_invalid, "/v1/chat/completions"),
    Attack("http_steered_call", http_steered_call, "/v1/chat/completions"),
    Attack("long_prompts", long_prompts),
    Attack("grpc_tools", grpc_tools),
    Attack("http_long", http_long, "/v1/completions"),
    Attack("http_long_chat", http_long_chat, "/v1/chat/completions"),
    Attack("grpc_choice", grpc_choice),
    Attack("http_completion_invalid", http_completion_invalid, "/v1/completions"),
    Attack("deep_body", deep_body, "/v1/chat/completions"),
    Attack("grpc_invalid", grpc_invalid),
]
