"""Qwen3's reasoning and tool-call parsers on scripted text, fed whole and in every split, which must agree."""
import json
import random

import pytest

from gateway.text.reasoning_parser import ReasoningParser, prompt_opens_reasoning
from gateway.text.tool_parser import ToolCallParser


def chunkings(text: str, seeds=range(12)):
    """The text whole, one character at a time, and in random pieces."""
    yield [text]
    yield list(text)
    for seed in seeds:
        rng, pieces, at = random.Random(seed), [], 0
        while at < len(text):
            step = rng.randint(1, 9)
            pieces.append(text[at:at + step])
            at += step
        yield pieces


def split_reasoning(pieces, in_reasoning=False):
    parser, reasoning, content = ReasoningParser(in_reasoning), "", ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("text, in_reasoning, want", [
    ("<think>\nAdd them.\n</think>\n\n4.", False, ("\nAdd them.\n", "\n\n4.")),
    ("\n<think>x</think>y", False, ("x", "y")),
    ("Add them.\n</think>\n\n4.", True, ("Add them.\n", "\n\n4.")),  # the prompt opened the block
    ("4. No thinking here </think>", False, ("", "4. No thinking here </think>")),
    ("<think>\ncut off by max_tokens </thi", False, ("\ncut off by max_tokens </thi", "")),
    ("<thin", False, ("", "<thin")),
    ("  ", False, ("", "  ")),
    ("<think>a</think>b<think>c</think>", False, ("a", "b<think>c</think>")),
    ("想一想 🤔</think>答案是 42", True, ("想一想 🤔", "答案是 42")),
])
def test_reasoning_split(text, in_reasoning, want):
    for pieces in chunkings(text):
        assert split_reasoning(pieces, in_reasoning) == want, pieces


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def parse_calls(pieces, parallel=True):
    """(content, calls) as a whole response gives them: each call's deltas joined as an OpenAI client joins
    them, and a call cut off by the end of the output left out, its text given as content."""
    parser, content, calls, first_seen = ToolCallParser(parallel), "", {}, []
    for i, piece in enumerate(pieces):
        c, deltas = parser.feed(piece, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.index not in calls:
                # The first delta of a call names it and carries its id.
                assert d.id.startswith("call_") and d.name, d
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
                first_seen.append(d.index)
            else:
                assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
            if d.cut_off is not None:
                assert i == len(pieces) - 1 and d.index == max(calls)  # only the last call, at the end
                content += d.cut_off
                del calls[d.index]
    assert first_seen == sorted(first_seen) == list(range(len(first_seen)))
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": {"a": [1, 2]}}}'
             '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("text, parallel, want", [
    (TWO_CALLS, True, ("Let me check.", [("get_weather", '{"city": "Paris", "n": {"a": [1, 2]}}'), ("now", "{}")])),
    (TWO_CALLS, False, ("Let me check.", [("get_weather", '{"city": "Paris", "n": {"a": [1, 2]}}')])),
    ('<tool_call>\n{"arguments": {"q": "ü \\"x\\""}, "name": "search"}\n</tool_call>\n', True,
     ("", [("search", '{"q": "ü \\"x\\""}')])),  # keys in the other order: parsed whole at the end
    ("no calls here, just < and <tool and a } brace ", True, ("no calls here, just < and <tool and a } brace ", [])),
    ("<tool_call>\nnot json\n</tool_call> after", True, ("<tool_call>\nnot json\n</tool_call> after", [])),
    ('<tool_call>{"name":"f","arguments":{"s":"}</tool"}}</tool_call>', True, ("", [("f", '{"s":"}</tool"}')])),
])
def test_tool_calls(text, parallel, want):
    for pieces in chunkings(text):
        assert parse_calls(pieces, parallel) == want, pieces


CUT_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'


@pytest.mark.parametrize("cut", [len("<tool_call>\n{\"na"), len('<tool_call>\n{"name": "get_weather", '),
                                 len(CUT_CALL), len(CUT_CALL + '"}}\n</tool_ca')])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_call_cut_off_by_the_end_of_the_output_is_content_not_a_call(cut, parallel):
    """Wherever max_tokens cuts a call (in its name, its arguments, its closing tag), the whole response has no
    such call: the block's text, as written, is content, after the calls that were complete."""
    first = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
    for text, want in [(CUT_CALL[:cut], (CUT_CALL[:cut], [])),
                       ("Checking.\n" + first + CUT_CALL[:cut], ("Checking." + (CUT_CALL[:cut] if parallel else ""),
                                                              [("now", "{}")]))]:
        for pieces in chunkings(text):
            assert parse_calls(pieces, parallel) == want, pieces


NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get\\q", "arguments": {}}\n</tool_call>',  # an invalid escape in the name
    '<tool_call>\n{"name": "get\\u12", "arguments": {}}\n</tool_call>',  # a short \\u escape
    '<tool_call>\n{"name": "get\x01weather", "arguments": {}}\n</tool_call>',  # a raw control character
    "<tool_call>" + "[" * 5000 + "</tool_call>",  # deeper than json.loads recurses
    '<tool_call>{"arguments": ' + "[" * 5000 + "]" * 5000 + ', "name": "f"}</tool_call>',  # the same, read whole
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
])
def test_text_that_is_not_a_call_is_content_and_the_calls_after_it_still_parse(bad):
    # Each block's text is checked against json.loads, the reference reader: none of them is a call.
    with pytest.raises((ValueError, RecursionError, AssertionError)):
        call = json.loads(bad[len("<tool_call>"):-len("</tool_call>")])
        assert isinstance(call["name"], str)
    text = "A\n" + bad + "\n" + NOW_CALL + "\n" + bad + "\n" + NOW_CALL + "\nB"
    for pieces in chunkings(text, seeds=range(4)):
        # The line break before a block is layout, whether or not the block turns out to be a call.
        assert parse_calls(pieces) == ("A" + bad + bad + "\nB", [("now", "{}"), ("now", "{}")]), pieces[:3]


def test_deeply_nested_arguments_of_a_well_formed_head_stream_through():
    arguments = "[" * 5000 + "]" * 5000
    text = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    for pieces in chunkings(text, seeds=range(2)):
        assert parse_calls(pieces) == ("", [("f", arguments)])


def test_streamed_arguments_are_valid_json_once_joined():
    for pieces in chunkings(TWO_CALLS):
        _, calls = parse_calls(pieces)
        assert [json.loads(arguments) for _, arguments in calls] == [{"city": "Paris", "n": {"a": [1, 2]}}, {}]


def test_name_comes_before_the_arguments_are_complete():
    parser = ToolCallParser()
    _, deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", ""), (None, '{"city": "Pa')]
