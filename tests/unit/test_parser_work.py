"""The chat parsers on the model's text as hostile input: work linear in the input, and any split of it
read as the whole.

Work is counted, not timed: every bytecode the parsers' own modules execute, plus, for every C function
they call (a regex, str.find, json.loads...), the length of the strings it may scan: its own string and
the strings in the calling frame's locals and on its `self`. A rescan of the growing text, in Python or
in C, makes that count grow with the square of the input.
"""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text import chat_output, reasoning_parser, tool_parser
from gateway.text.chat_output import ChatOutput
from gateway.text.reasoning_parser import ReasoningParser
from gateway.text.tool_parser import ToolCallParser
from tests.unit.test_chat_parsers import parse_calls, split_reasoning

PARSER_FILES = {module.__file__ for module in (tool_parser, reasoning_parser, chat_output)}


def _text_size(value) -> int:
    return len(value) if isinstance(value, str) else 0


def work_of(run, files=PARSER_FILES) -> int:
    """The work of the code in `files` while `run()` runs (see the module's docstring)."""
    work = 0

    def count_opcodes(frame, event, arg):
        nonlocal work
        if event == "opcode":
            work += 1
        return count_opcodes

    def trace(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        frame.f_trace_opcodes = True
        return count_opcodes

    def profile(frame, event, arg):
        nonlocal work
        if event != "c_call" or frame.f_code.co_filename not in files:
            return
        local_values = list(frame.f_locals.values())
        owner = frame.f_locals.get("self")
        attributes = list(vars(owner).values()) if hasattr(owner, "__dict__") else []
        work += 1 + _text_size(getattr(arg, "__self__", None)) + sum(map(_text_size, local_values + attributes))

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return work


def token_pieces(text: str) -> list[str]:
    """The text in pieces of 1 to 4 characters, as a stream of tokens brings it (the same split every run)."""
    pieces, at, step = [], 0, 0
    while at < len(text):
        size = 1 + step % 4
        pieces.append(text[at:at + size])
        at, step = at + size, step + 1
    return pieces


def feed_tools(text: str, final: bool = True):
    parser = ToolCallParser()
    pieces = token_pieces(text)
    return lambda: [parser.feed(p, final=final and i == len(pieces) - 1) for i, p in enumerate(pieces)]


def feed_reasoning(text: str):
    parser = ReasoningParser()
    pieces = token_pieces(text)
    return lambda: [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def feed_chat(text: str):
    output = ChatOutput(ReasoningParser(), ToolCallParser())
    pieces = token_pieces(text)
    return lambda: [output.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


HEAD = '<tool_call>\n{"name": "get_weather", "arguments": '
HOSTILE = {
    # Whitespace runs inside a call's arguments, then any other character (the old tail regex's cubic case).
    "spaces in arguments": lambda n: feed_tools(HEAD + '{"city": "' + " " * n + 'x"}}\n</tool_call>'),
    "spaces after a brace": lambda n: feed_tools(HEAD + "{}" + " " * n + "x}\n</tool_call>"),
    "braces and spaces": lambda n: feed_tools(HEAD + "{" + "} " * n + "}\n</tool_call>"),
    "a long argument": lambda n: feed_tools(HEAD + '{"city": "' + "Paris" * n + '"}}\n</tool_call>'),
    # A name that never ends, and blocks that are never calls.
    "unterminated name": lambda n: feed_tools('<tool_call>\n{"name": "' + "ab" * n, final=False),
    "unterminated name, final": lambda n: feed_tools('<tool_call>\n{"name": "' + "ab" * n),
    "escapes in a name": lambda n: feed_tools('<tool_call>{"name": "' + "\\n" * n + '", "arguments": {}}</tool_call>'),
    "nested brackets": lambda n: feed_tools("<tool_call>" + "[" * n + "</tool_call>"),
    "spaces before the head": lambda n: feed_tools("<tool_call>" + " " * n + "x</tool_call>"),
    "almost a closing tag": lambda n: feed_tools(HEAD + "{" + "</tool_cal" * n + "}</tool_call>"),
    # Outside any call: whitespace that may come before one, and tag starts.
    "spaces before a call": lambda n: feed_tools(" " * n + "x" + " " * n + "<tool_call>" + "\n" * n),
    "almost an opening tag": lambda n: feed_tools("<tool_cal" * n),
    # Reasoning: whitespace before a think block, a long one, and both parsers together.
    "spaces before thinking": lambda n: feed_reasoning(" " * n + "x"),
    "spaces then a think block": lambda n: feed_reasoning("\n" * n + "<think>" + "</thin" * n + "</think>"),
    "chat": lambda n: feed_chat(" " * n + "<think>" + "a" * n + "</think>" + "\n" * n + HEAD + " " * n + "{}}"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_parser_work_grows_linearly_with_the_input(case):
    small, large = work_of(HOSTILE[case](500)), work_of(HOSTILE[case](2000))
    # Four times the input: about four times the work (a square would be sixteen).
    assert large < 5 * small, (small, large)


def test_the_work_counter_sees_a_rescan():
    """The counter itself: a parser that re-reads its whole text on every piece, in C, is caught."""
    class Rescanning(ToolCallParser):
        def feed(self, text, final=False):
            self.seen = getattr(self, "seen", "") + text
            self.seen.find(tool_parser.CALL_END)
            return super().feed(text, final)

    def feed(n):
        parser, pieces = Rescanning(), token_pieces(HEAD + " " * n)
        return lambda: [parser.feed(p) for p in pieces]
    files = PARSER_FILES | {__file__}
    assert work_of(feed(2000), files) > 8 * work_of(feed(500), files)


# Fragments the parsers treat specially, so random texts hit tag boundaries, heads, escapes and tails.
FRAGMENTS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool", "</tool", "<thi", "<", "\n", " ", "  ",
             "}", "{", '"', "\\", "x", "é", '{"name": "f", "arguments": ', '{"name": "g\\"h", "arguments":',
             '{"arguments": {}, "name": "k"}', '{"a": [1, 2]}', "[[[", "]]]", '"\\q"', "\x01"]


def splits(draw_cuts, text: str) -> list[str]:
    cuts = sorted({min(c, len(text)) for c in draw_cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]


def chat_split(pieces: list[str]):
    """(reasoning, content, calls) as a whole response gives them, each call as (name, arguments)."""
    output = ChatOutput(ReasoningParser(), ToolCallParser())
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        r, c, deltas = output.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            call = calls.setdefault(d.index, [d.name, ""])
            call[1] += d.arguments
            if d.cut_off is not None:
                content += d.cut_off
                del calls[d.index]
    return reasoning, content, sorted(calls.items()), output.called_tools


texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)
cut_points = st.lists(st.integers(min_value=0, max_value=400), max_size=40)


@settings(max_examples=300, deadline=None)
@given(texts, cut_points, st.booleans())
def test_any_split_reads_as_the_whole(text, cuts, parallel):
    pieces = splits(cuts, text)
    assert "".join(pieces) == text
    assert parse_calls(pieces, parallel) == parse_calls([text], parallel)
    assert split_reasoning(pieces) == split_reasoning([text])
    assert chat_split(pieces) == chat_split([text])
