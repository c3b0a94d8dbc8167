"""Structured output through the services: the real `openai` client (OpenAI's and vLLM's spellings, and its
`.parse()`), LangChain and gRPC, with thinking on and off, on a tiny random Qwen3 with the real vocabulary,
sampled at temperature 1 so that only the constraint can make the output fit."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest
from tokenizers import Tokenizer

from tests.integration.stack import child_pids
from vllm_v0.gateway.v1 import gateway_pb2

SEEDS = range(4)
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "alive": {"type": "boolean"},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "alive", "legs", "tags", "owner"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture()
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(stack) -> str:
    """The served model's name, found as a client finds it (the gateway answers 404 to any other)."""
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        return c.models.list().data[0].id


def chat(client, model, **kwargs):
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, max_tokens=100,
                                          **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
def test_response_format_json_schema_validates(client, seed, model):
    reply = chat(client, model, seed=seed, extra_body=NO_THINKING, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PET)


@pytest.mark.parametrize("seed", SEEDS)
def test_vllm_structured_outputs_json_on_completions_validates(client, seed, model):
    reply = client.completions.create(model=model, prompt="A pet:", temperature=1.0, max_tokens=100, seed=seed,
                                      extra_body={"structured_outputs": {"json": PET}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), PET)


@pytest.mark.parametrize("seed", SEEDS)
def test_response_format_json_object_is_an_object(client, checkpoint, seed, model):
    # Keys and values of any object are free text. A random model over 151,936 tokens almost never picks a
    # token that closes a string, so on its own it writes one key until max_tokens. A bias on '"' stands in
    # for a model that knows to close its strings; the mask still decides every other token.
    quote = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id('"')
    reply = chat(client, model, seed=seed, extra_body=NO_THINKING, response_format={"type": "json_object"},
                 logit_bias={str(quote): 30})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_fullmatches(client, seed, model):
    reply = chat(client, model, seed=seed, extra_body={**NO_THINKING, "structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", SEEDS)
def test_choice_is_one_of_the_choices(client, seed, model):
    reply = client.completions.create(model=model, prompt="Sentiment:", temperature=1.0, max_tokens=20, seed=seed,
                                      extra_body={"structured_outputs": {"choice": CHOICES}})
    assert reply.choices[0].text in CHOICES and reply.choices[0].finish_reason == "stop"
    older = client.completions.create(model=model, prompt="Sentiment:", temperature=1.0, max_tokens=20,
                                      seed=seed, extra_body={"guided_choice": CHOICES})
    assert older.choices[0].text == reply.choices[0].text  # the same constraint, the same seed


def test_grammar_streams_a_match(client, model):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    chunks = list(client.completions.create(model=model, prompt="Sum:", temperature=1.0, max_tokens=40, seed=1,
                                            stream=True, extra_body={"structured_outputs": {"grammar": grammar}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) or chunks[-1].choices[0].finish_reason == "length"
    assert text.startswith("(")


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "strng"),
    ({"structured_outputs": {"regex": "[a-z"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "one structured-output constraint"),
])
def test_invalid_constraints_are_400_naming_the_problem(client, body, needle, model):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, extra_body={**NO_THINKING, **body})
    assert needle in e.value.body["message"] if isinstance(e.value.body, dict) else needle in str(e.value)


def test_unknown_output_changing_field_is_refused_and_user_is_not(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, extra_body={"guided_decoding_backend": "xgrammar"})
    assert e.value.body["param"] == "guided_decoding_backend"
    assert chat(client, model, user="someone", max_completion_tokens=None, extra_body=NO_THINKING).choices


def test_unconstrained_greedy_unchanged_beside_constrained(client, model):
    def plain():
        return client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                         max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text

    alone = plain()
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.completions.create, model=model, prompt="A pet:", temperature=1.0,
                                   max_tokens=100, seed=s, extra_body={"structured_outputs": {"json": PET}})
                       for s in range(3)]
        together = pool.submit(plain)
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].text), PET)
        assert together.result() == alone


def test_grpc_structured_output(gateway):
    request = gateway_pb2.GenerateRequest(prompt="A pet:", temperature=1.0, seed=3, max_tokens=100,
                                          structured_output=gateway_pb2.StructuredOutput(json_schema=json.dumps(PET)))
    text = "".join(m.text for m in gateway.Generate(request))
    jsonschema.validate(json.loads(text), PET)
    choice = gateway_pb2.GenerateRequest(prompt="Sentiment:", temperature=1.0, seed=3, max_tokens=10,
                                         structured_output=gateway_pb2.StructuredOutput(
                                             choice=gateway_pb2.StructuredOutput.Choices(choices=CHOICES)))
    messages = list(gateway.Generate(choice))
    assert "".join(m.text for m in messages) in CHOICES
    # The grammar's completion ends it as an eos would, with no eos text to report.
    assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_EOS and messages[-1].stop_reason == ""
    bad = gateway_pb2.GenerateRequest(prompt="x", structured_output=gateway_pb2.StructuredOutput(regex="(a"))
    with pytest.raises(grpc.RpcError) as e:
        list(gateway.Generate(bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()


def test_grpcurl_structured_output_as_in_the_readme(stack):
    """The README's grpcurl shape: the oneof and the choice wrapper in proto JSON, through reflection."""
    grpcurl = shutil.which("grpcurl") or str(pathlib.Path(sys.executable).parent / "grpcurl")
    body = json.dumps({"prompt": "Sentiment:", "max_tokens": 8,
                       "structured_output": {"choice": {"choices": ["positive", "negative"]}}})
    result = subprocess.run([grpcurl, "-plaintext", "-d", body, stack.gateway.address,
                             "vllm_v0.gateway.v1.GatewayService/Generate"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    messages = [json.loads(m) for m in result.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(m.get("text", "") for m in messages) in ("positive", "negative")
    assert messages[-1]["finish_reason"] == "FINISH_REASON_EOS"


# -- structured output with thinking on (Qwen3's chat default) and off, as clients ask for it ----------------


class Pet(pydantic.BaseModel):
    """What `.parse()` and LangChain send as a strict JSON schema. Bounded strings and numbers: a random model
    never chooses to close a string, so the bounds are what end it (the grammar forces the quote)."""
    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog", "bird"]
    alive: bool
    legs: int = pydantic.Field(ge=0, le=8)


def steered_to_think(checkpoint) -> dict:
    """Sampling that makes a random model think briefly and then answer: +100 on <think> opens the block, each
    further <think> costs it 2 (frequency) on top of 2 (presence), so after about ten </think> (+80) wins and
    closes it; from there the grammar decides every token, and </think> is masked. Thinking on, nothing in the
    prompt closes the block: without the model's </think> the constraint never starts."""
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return {"logit_bias": {str(tokenizer.token_to_id("<think>")): 100, str(tokenizer.token_to_id("</think>")): 80},
            "frequency_penalty": 2.0, "presence_penalty": 2.0}


def parse_pet(client, model, seed: int, **kwargs):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return parse(model=model, messages=MESSAGES, response_format=Pet, temperature=1.0, max_tokens=200, seed=seed,
                 **kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_openai_parse_with_thinking_on_reasons_first_then_answers(client, checkpoint, seed, model):
    reply = parse_pet(client, model, seed, **steered_to_think(checkpoint))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)
    assert Pet.model_validate_json(message.content) == message.parsed
    # The think block came first, and is not part of the answer.
    assert message.model_extra.get("reasoning_content") and "think>" not in message.content


@pytest.mark.parametrize("seed", range(3))
def test_openai_parse_with_thinking_off(client, seed, model):
    reply = parse_pet(client, model, seed, extra_body=NO_THINKING)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Pet)
    assert reply.choices[0].message.model_extra.get("reasoning_content") is None


def langchain_model(stack, model, seed: int, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=stack.http_url + "/v1", api_key="unused", model=model, temperature=1.0,
                      max_tokens=200, seed=seed, max_retries=0, timeout=120, **kwargs)


@pytest.mark.parametrize("thinking", [True, False])
def test_langchain_with_structured_output_default_method(stack, checkpoint, thinking, model):
    """LangChain's default method (json_schema: OpenAI's response_format through the client's .parse)."""
    steering = steered_to_think(checkpoint) if thinking else {"extra_body": NO_THINKING}
    for seed in range(2):
        structured = langchain_model(stack, model, seed, **steering).with_structured_output(Pet)
        assert isinstance(structured.invoke("Describe a pet."), Pet)


# -- a schema built to break the compiler fails alone, however it arrives ------------------------------------


def deep_schema(levels: int = 70) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_deep_schema_fails_alone_by_every_route_and_the_engine_core_lives(stack, client, gateway, model):
    """HTTP response_format, vLLM's structured_outputs / guided_json (a string) and gRPC: each is refused as
    invalid while a stream beside them finishes whole, on the same engine core process."""
    cores = child_pids(stack.worker.process.pid)
    schema = deep_schema()
    beside = gateway_pb2.GenerateRequest(prompt="A long story:", max_tokens=80, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        neighbour = pool.submit(lambda: [m for m in gateway.Generate(beside, timeout=120)])
        http_bodies = [
            {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}},
            {"structured_outputs": {"json": json.dumps(schema)}},
            {"guided_json": json.dumps(schema)},
        ]
        for body in http_bodies:
            with pytest.raises(openai.BadRequestError) as e:
                chat(client, model, extra_body={**NO_THINKING, **body})
            assert "nested" in str(e.value), body
        deep = gateway_pb2.GenerateRequest(prompt="x", max_tokens=8, structured_output=gateway_pb2.StructuredOutput(
            json_schema=json.dumps(schema)))
        with pytest.raises(grpc.RpcError) as e:
            list(gateway.Generate(deep, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested" in e.value.details()
        messages = neighbour.result(timeout=180)
    assert sum(len(m.token_ids) for m in messages) == 80
    assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert child_pids(stack.worker.process.pid) == cores  # the same core: never restarted
