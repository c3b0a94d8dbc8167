"""The HTTP spellings of structured output (OpenAI's, vLLM's current and older) as one (kind, value) pair."""
import json

import pytest

from gateway.http_api.openai_errors import error_body
from gateway.http_api.openai_protocol import ChatRequest, CompletionRequest, chat_request, completion_requests, parse
from rpcserver.errors import InvalidArgument

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return chat_request(parse(ChatRequest, json.dumps({**CHAT, **fields}).encode()))


def completion(**fields):
    return completion_requests(parse(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode()))[0]


@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     ("json_schema", SCHEMA)),
    ({"response_format": {"type": "json_object"}}, ("json_object", True)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json_schema", SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}, ("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ["a", "b"])),
    ({"structured_outputs": {"grammar": "root ::= \"x\""}}, ("grammar", "root ::= \"x\"")),
    ({"structured_outputs": {"json_object": True}}, ("json_object", True)),
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA)),
    ({"guided_regex": "a+"}, ("regex", "a+")),
    ({"guided_choice": ["a"]}, ("choice", ["a"])),
    ({"guided_grammar": "start: \"a\""}, ("grammar", "start: \"a\"")),
])
@pytest.mark.parametrize("endpoint", [chat, completion])
def test_every_spelling_on_both_endpoints(endpoint, fields, want):
    got = endpoint(**fields).structured_output
    if want is not None and want[0] == "json_schema":
        got = (got[0], json.loads(got[1]))
    assert got == want


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema"),
    ({"structured_outputs": {}}, "structured_outputs must hold exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs must hold exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag is not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex: give one"),
])
def test_bad_spellings_name_the_field(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        chat(**fields)


def test_unknown_fields_are_refused_with_param_and_labels_are_not():
    with pytest.raises(InvalidArgument) as e:
        completion(min_tokens=3)
    status, body = error_body(e.value)
    assert status == 400 and body["error"]["param"] == "min_tokens" and "min_tokens" in body["error"]["message"]
    assert completion(user="u", metadata={"k": "v"}, store=False, service_tier="auto").structured_output is None
