"""Qwen3's (Hermes-style) tool-call parser: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

Fed the content text a piece at a time, it returns the text outside the blocks and OpenAI-style
call deltas: a call's first delta has its id and name, the next ones pieces of its arguments' JSON
text. Joining a call's pieces gives its arguments, so a stream and a whole body agree.

The text is the model's, so it is read as hostile input: one pass, each character looked at a
bounded number of times, whatever the pieces (no regex re-run over the growing block, no recursion).
A block it cannot read goes out as content, tags and all, and the blocks after it are read as usual.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from gateway.text.reasoning_parser import held_tag_prefix

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"

# Linear scans: a single greedy class, so a match never backtracks.
_SPACE = re.compile(r"\s*")
_NAME_RUN = re.compile(r'[^"\\]*')


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the message's tool_calls
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""  # a piece of the arguments' JSON text
    # Set on a call's last delta when the output ended inside the call (max_tokens, a stop string):
    # its text as written, "<tool_call>" included. A whole response gives that text as content
    # rather than a truncated call; a stream has already sent the call's pieces as they came.
    cut_off: str | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_NAME, _ARGUMENTS = object(), object()
# The opening Qwen3 writes, as its template shows it, with whitespace allowed before each literal:
# once `"arguments":` is read, the name is known and the rest is the arguments' text.
_HEAD = ("{", '"name"', ":", '"', _NAME, ",", '"arguments"', ":", _ARGUMENTS)


class CallHead:
    """Reads a block's `{"name": "...", "arguments": ` across pieces, each character once."""

    def __init__(self):
        self.step = 0  # index in _HEAD
        self.matched = 0  # characters of the current literal read
        self.name_pieces: list[str] = []  # the name's JSON string text, escapes as written
        self.escaped = False  # the name's last character was a backslash
        self.name: str | None = None
        self.failed = False  # not this shape: the block is read whole once it closes

    def feed(self, text: str) -> int | None:
        """Where in `text` the arguments start, once the head is complete; None until then or on failure."""
        i = 0
        while i < len(text) and not self.failed:
            step = _HEAD[self.step]
            if step is _NAME:
                i = self._read_name(text, i)
                continue
            if self.matched == 0:
                i = _SPACE.match(text, i).end()
                if i == len(text):
                    break
            if step is _ARGUMENTS:
                return i
            if text[i] != step[self.matched]:
                self.failed = True
                break
            self.matched += 1
            i += 1
            if self.matched == len(step):
                self.step, self.matched = self.step + 1, 0
        return None

    def _read_name(self, text: str, i: int) -> int:
        if self.escaped:  # the escaped character, whatever it is: json.loads judges the escape at the end
            self.name_pieces.append(text[i])
            self.escaped = False
            return i + 1
        end = _NAME_RUN.match(text, i).end()
        self.name_pieces.append(text[i:end])
        if end == len(text):
            return end
        if text[end] == "\\":
            self.name_pieces.append("\\")
            self.escaped = True
            return end + 1
        try:  # the closing quote; strict json.loads refuses a bad escape or a raw control character
            self.name = json.loads('"' + "".join(self.name_pieces) + '"')
        except ValueError:
            self.failed = True
        self.step += 1
        return end + 1


class ArgumentStream:
    """A call's arguments text, released as it comes except what may still be the end of the call object:
    trailing whitespace, or its closing brace with whitespace around it. Only the new piece is scanned."""

    def __init__(self):
        self.held: list[str] = []  # text not released yet, in pieces
        self.held_chars = 0
        self.space_at: int | None = None  # where in `held` a run of trailing whitespace starts
        self.brace_at: int | None = None  # where in `held` a trailing `\s*}\s*` starts

    def feed(self, text: str) -> str:
        """The part of the arguments that is now known not to be the call's end."""
        if not text:
            return ""
        base = self.held_chars
        self.held.append(text)
        self.held_chars += len(text)
        body = text.rstrip()
        trailing = base + len(body) if len(body) < len(text) else None
        if not body:  # all whitespace: a run that started here or before goes on
            self.space_at = base if self.space_at is None else self.space_at
        elif body.endswith("}"):
            before = body[:-1].rstrip()
            # A second brace ends any earlier candidate; the whitespace before this one may reach back.
            self.brace_at = base + len(before) if before else (base if self.space_at is None else self.space_at)
            self.space_at = trailing
        else:
            self.brace_at, self.space_at = None, trailing
        safe = next((at for at in (self.brace_at, self.space_at) if at is not None), self.held_chars)
        if safe == 0:
            return ""
        # Every released character is joined here once; what stays held lies within the last few pieces.
        held = "".join(self.held)
        rest = held[safe:]
        self.held, self.held_chars = ([rest] if rest else []), len(rest)
        self.brace_at = None if self.brace_at is None else self.brace_at - safe
        self.space_at = None if self.space_at is None else self.space_at - safe
        return held[:safe]

    def close(self) -> str:
        """The rest of the arguments once the block has closed: without the call object's brace."""
        rest = "".join(self.held).rstrip()
        return rest[:-1].rstrip() if rest.endswith("}") else rest


class ToolCallParser:
    """One completion's calls. With `parallel` false, blocks after the first call are dropped."""

    def __init__(self, parallel: bool = True, forced: bool = False):
        self.parallel = parallel
        # A forced tool choice's grammar allows only calls: a call cut off there is dropped, not content.
        self.forced = forced
        self.calls = 0  # calls started so far: the next call's index
        self.finished_calls = 0  # calls whose block closed
        self.in_call = False
        self.held_tag = ""  # a possible start of <tool_call> (outside a block) or </tool_call> (inside one)
        self.held_space: list[str] = []  # outside a block: whitespace that may be the layout before a call
        # The current block.
        self.dropping = False  # a call beyond the one allowed: read to its end and left out
        self.block: list[str] = []  # its text after <tool_call>, in pieces
        self.head: CallHead | None = None  # until its name is read
        self.arguments: ArgumentStream | None = None  # once its name is read and its call has started

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) of `text`; at `final` everything held is released."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        rest: str | None = text
        while rest is not None:
            rest = self._feed_call(rest, final, content, deltas) if self.in_call else self._feed_outside(rest, content)
        if final:
            # Whitespace after the last call is layout; a held "<tool" is text.
            if self.held_tag or not self.calls:
                content += self.held_space + [self.held_tag]
            self.held_space, self.held_tag = [], ""
        return "".join(content), deltas

    def _feed_outside(self, text: str, content: list[str]) -> str | None:
        """Content up to the next <tool_call>; the text after it, or None when none is in sight."""
        text, self.held_tag = self.held_tag + text, ""
        start = text.find(CALL_START)
        if start >= 0:
            shown = text[:start].rstrip()  # the line break before a call is layout, not content
            if shown:
                content += self.held_space + [shown]
            self.held_space = []
            self._open_call()
            return text[start + len(CALL_START):]
        held = held_tag_prefix(text, CALL_START)
        rest = text[:len(text) - held]
        shown = rest.rstrip()
        if shown:
            content += self.held_space + [shown]
            self.held_space = []
        if len(shown) < len(rest):
            self.held_space.append(rest[len(shown):])
        self.held_tag = text[len(text) - held:]
        return None

    def _open_call(self) -> None:
        self.in_call, self.block, self.arguments = True, [], None
        self.dropping = not self.parallel and self.calls >= 1
        self.head = None if self.dropping else CallHead()

    def _feed_call(self, text: str, final: bool, content: list[str], deltas: list[ToolCallDelta]) -> str | None:
        """The block's text up to </tool_call>; the text after it, or None while the block goes on."""
        text, self.held_tag = self.held_tag + text, ""
        end = text.find(CALL_END)
        if end >= 0:
            self._add_to_block(text[:end], deltas)
            self._close_call(content, deltas)
            return text[end + len(CALL_END):]
        # The closing tag may arrive split across pieces: a possible start of it is not block text yet.
        held = 0 if final else held_tag_prefix(text, CALL_END)
        self._add_to_block(text[:len(text) - held], deltas)
        self.held_tag = text[len(text) - held:]
        if final:
            self._cut_off(content, deltas)
        return None

    def _add_to_block(self, text: str, deltas: list[ToolCallDelta]) -> None:
        if self.dropping or not text:
            return
        self.block.append(text)
        if self.head is not None:
            start = self.head.feed(text)
            if start is None:
                return
            deltas.append(ToolCallDelta(self.calls, new_call_id(), self.head.name))
            self.calls += 1
            self.head, self.arguments, text = None, ArgumentStream(), text[start:]
        if self.arguments is not None:
            piece = self.arguments.feed(text)
            if piece:
                deltas.append(ToolCallDelta(self.calls - 1, arguments=piece))

    def _close_call(self, content: list[str], deltas: list[ToolCallDelta]) -> None:
        self.in_call = False
        if self.dropping:
            return
        if self.arguments is not None:
            piece = self.arguments.close()
            if piece:
                deltas.append(ToolCallDelta(self.calls - 1, arguments=piece))
            self.finished_calls += 1
            return
        block = "".join(self.block)
        call = read_call(block)
        if call is None:
            content.append(CALL_START + block + CALL_END)  # not a call after all: the model's text, as written
            return
        name, arguments = call
        deltas.append(ToolCallDelta(self.calls, new_call_id(), name, arguments))
        self.calls += 1
        self.finished_calls += 1

    def _cut_off(self, content: list[str], deltas: list[ToolCallDelta]) -> None:
        """The output ended inside a block: never a call. As vLLM's hermes parser, whose whole response
        gives text it cannot read as a call as content, the block's text is content; a call whose pieces
        already went out (a stream) gets a last delta that says so. Under a forced tool choice the
        output was to be calls alone, so the cut block is dropped: half a call is neither call nor content."""
        self.in_call = False
        if self.dropping:
            return
        text = "" if self.forced else CALL_START + "".join(self.block)
        if self.arguments is not None:
            deltas.append(ToolCallDelta(self.calls - 1, cut_off=text))
        elif text:
            content.append(text)


def read_call(block: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a whole block, or None when it is not a call."""
    try:
        call = json.loads(block)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        # A nesting deeper than the interpreter's stack raises RecursionError (json.loads stops there, in
        # time linear in what it read): text, not a call.
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return call["name"], text
