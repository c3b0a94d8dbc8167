"""The request side of tool calling: tool checks, what the prompt offers, and the forced-call constraint."""
import json

import jsonschema
import pytest

from gateway.core.tools import check_tools, forced_call_constraint, offered_tools, tool_call_grammar, tool_names
from rpcserver.errors import InvalidArgument

WEATHER = json.dumps({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False}}})
CLOCK = json.dumps({"type": "function", "function": {"name": "now"}})


def test_auto_and_none_need_no_constraint_and_none_offers_nothing():
    assert forced_call_constraint([WEATHER], "auto") is None and forced_call_constraint([WEATHER], "none") is None
    assert offered_tools([WEATHER], "none") == [] and offered_tools([WEATHER], "auto") == [WEATHER]
    assert offered_tools([WEATHER], "required") == [WEATHER] == offered_tools([WEATHER], "get_weather")


def schemas(tools, choice):
    constraint = forced_call_constraint(tools, choice)
    assert constraint["type"] == "structural_tag" and constraint["triggers"] == ["<tool_call>"]
    assert all(s["begin"] == "<tool_call>\n" and s["end"] == "\n</tool_call>" for s in constraint["structures"])
    return [s["schema"] for s in constraint["structures"]]


def valid_for_any(schema_list, call) -> bool:
    return any(jsonschema.Draft202012Validator(s).is_valid(call) for s in schema_list)


@pytest.mark.parametrize("call, required_ok, named_ok", [
    ({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, True, True),
    ({"name": "get_weather", "arguments": {"days": 2}}, False, False),  # a required argument missing
    ({"name": "get_weather", "arguments": {"city": "Paris", "days": 0}}, False, False),
    ({"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}, False, False),
    ({"name": "now", "arguments": {}}, True, False),  # another tool: fine for required, not for the named one
    ({"name": "nope", "arguments": {}}, False, False),
    ({"name": "now"}, False, False),
])
def test_the_constraint_admits_exactly_the_valid_calls(call, required_ok, named_ok):
    assert valid_for_any(schemas([WEATHER, CLOCK], "required"), call) is required_ok
    assert valid_for_any(schemas([WEATHER, CLOCK], "get_weather"), call) is named_ok


@pytest.mark.parametrize("tools, choice, words", [
    (["{"], "auto", "tools[0] is not valid JSON"),
    (['{"type": "function"}'], "auto", "tools[0] must be"),
    (['{"type": "function", "function": {"name": ""}}'], "auto", "tools[0].function.name"),
    (['{"type": "function", "function": {"name": "f", "parameters": []}}'], "auto", "tools[0].function.parameters"),
    ([], "required", "no tools"),
    ([WEATHER], "get_time", "'get_time'"),
])
def test_bad_tools_are_named(tools, choice, words):
    with pytest.raises(InvalidArgument) as error:
        check_tools(tools, choice)
    assert words in str(error.value)


def test_tool_names():
    assert tool_names([WEATHER, CLOCK]) == ["get_weather", "now"]


@pytest.fixture(scope="module")
def grammar_tokens(demo_tokenizer_dir):
    """(llguidance tokenizer with Qwen3's end-of-sequence ids, `tokenizers`' encoder, those ids) on the demo vocab."""
    import llguidance
    from tokenizers import Tokenizer

    path = demo_tokenizer_dir / "tokenizer.json"
    encoder = Tokenizer.from_file(str(path))
    eos = sorted(encoder.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    return llguidance.LLTokenizer(path.read_text(), n_vocab=encoder.get_vocab_size(), eos_token=eos), encoder, eos


def allowed_ids(matcher) -> set[int]:
    import numpy

    bits = numpy.unpackbits(numpy.frombuffer(matcher.compute_bitmask(), dtype=numpy.uint8), bitorder="little")
    return set(numpy.flatnonzero(bits).tolist())


# As the grammar's compact JSON writes them.
WEATHER_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
CLOCK_CALL = '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'


@pytest.mark.parametrize("choice, parallel, first, more_allowed", [
    ("get_weather", True, WEATHER_CALL, False),  # a named function: one call, parallel or not
    ("get_weather", False, WEATHER_CALL, False),
    ("required", False, CLOCK_CALL, False),
    ("required", True, CLOCK_CALL, True),  # "required" with parallel calls: one or more
])
def test_the_forced_call_grammar_ends_after_its_calls(grammar_tokens, choice, parallel, first, more_allowed):
    import llguidance

    tokenizer, encoder, eos = grammar_tokens
    grammar = tool_call_grammar(forced_call_constraint([WEATHER, CLOCK], choice), parallel)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(encoder.encode(first).ids), matcher.get_error()
    second = encoder.encode("\n" + WEATHER_CALL).ids
    if more_allowed:
        assert matcher.validate_tokens(second) == len(second) and set(eos) <= allowed_ids(matcher)
    else:
        # Complete: the worker ends the sequence here, and the only token the grammar still admits is an end.
        assert matcher.is_stopped() and allowed_ids(matcher) == set(eos)
        assert matcher.validate_tokens(second) == 0 and matcher.validate_tokens(encoder.encode(" ").ids) == 0


@pytest.mark.parametrize("lead, after_reasoning, taken", [
    ("\n\n", True, True),  # Qwen3's blank line after </think>: one token
    ("\n", True, True),
    ("", True, True),
    ("\n\n\n", True, False),  # a blank line, not a run of whitespace
    ("Sure. ", True, False),  # nothing but the calls, even after the reasoning
    ("\n\n", False, False),  # thinking off: the call from the first token, as the prompt ends with the blank line
])
def test_after_the_reasoning_the_grammar_lets_qwen3_write_its_blank_line(grammar_tokens, lead, after_reasoning,
                                                                          taken):
    import llguidance

    tokenizer, encoder, eos = grammar_tokens
    grammar = tool_call_grammar(forced_call_constraint([WEATHER, CLOCK], "get_weather"), True, after_reasoning)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.get_error(), matcher.get_error()
    ids = encoder.encode(lead + WEATHER_CALL).ids
    assert (matcher.validate_tokens(ids) == len(ids)) == taken
    if taken:
        assert matcher.consume_tokens(ids) and matcher.is_stopped() and allowed_ids(matcher) == set(eos)
