"""Structured output through the services: the real `openai` client (OpenAI's and vLLM's spellings) and gRPC,
on a tiny random Qwen3 with the real vocabulary, sampled at temperature 1 so that only the constraint can
make the output fit."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

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


def chat(client, **kwargs):
    return client.chat.completions.create(model="any", messages=MESSAGES, temperature=1.0, max_tokens=100,
                                          **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
def test_response_format_json_schema_validates(client, seed):
    reply = chat(client, seed=seed, extra_body=NO_THINKING, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PET)


@pytest.mark.parametrize("seed", SEEDS)
def test_vllm_structured_outputs_json_on_completions_validates(client, seed):
    reply = client.completions.create(model="any", prompt="A pet:", temperature=1.0, max_tokens=100, seed=seed,
                                      extra_body={"structured_outputs": {"json": PET}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), PET)


@pytest.mark.parametrize("seed", SEEDS)
def test_response_format_json_object_is_an_object(client, checkpoint, seed):
    # Keys and values of any object are free text. A random model over 151,936 tokens almost never picks a
    # token that closes a string, so on its own it writes one key until max_tokens. A bias on '"' stands in
    # for a model that knows to close its strings; the mask still decides every other token.
    quote = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id('"')
    reply = chat(client, seed=seed, extra_body=NO_THINKING, response_format={"type": "json_object"},
                 logit_bias={str(quote): 30})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_fullmatches(client, seed):
    reply = chat(client, seed=seed, extra_body={**NO_THINKING, "structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", SEEDS)
def test_choice_is_one_of_the_choices(client, seed):
    reply = client.completions.create(model="any", prompt="Sentiment:", temperature=1.0, max_tokens=20, seed=seed,
                                      extra_body={"structured_outputs": {"choice": CHOICES}})
    assert reply.choices[0].text in CHOICES and reply.choices[0].finish_reason == "stop"
    older = client.completions.create(model="any", prompt="Sentiment:", temperature=1.0, max_tokens=20,
                                      seed=seed, extra_body={"guided_choice": CHOICES})
    assert older.choices[0].text == reply.choices[0].text  # the same constraint, the same seed


def test_grammar_streams_a_match(client):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    chunks = list(client.completions.create(model="any", prompt="Sum:", temperature=1.0, max_tokens=40, seed=1,
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
def test_invalid_constraints_are_400_naming_the_problem(client, body, needle):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={**NO_THINKING, **body})
    assert needle in e.value.body["message"] if isinstance(e.value.body, dict) else needle in str(e.value)


def test_unknown_output_changing_field_is_refused_and_user_is_not(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"guided_decoding_backend": "xgrammar"})
    assert e.value.body["param"] == "guided_decoding_backend"
    assert chat(client, user="someone", max_completion_tokens=None, extra_body=NO_THINKING).choices


def test_unconstrained_greedy_unchanged_beside_constrained(client):
    def plain():
        return client.completions.create(model="any", prompt="The capital of France is", temperature=0,
                                         max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text

    alone = plain()
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.completions.create, model="any", prompt="A pet:", temperature=1.0,
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
