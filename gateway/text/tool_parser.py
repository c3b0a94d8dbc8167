"""Qwen3's (Hermes-style) tool-call parser: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

Fed the content text a piece at a time, it returns the text outside the blocks and OpenAI-style
call deltas: a call's first delta has its id and name, the next ones pieces of its arguments' JSON
text. Joining a call's pieces gives its arguments, so a stream and a whole body agree.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from gateway.text.reasoning_parser import held_tag_prefix

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"

# The opening Qwen3 writes, as its template shows it: once it is seen, the name is known and
# everything up to the object's closing brace is the arguments' text.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still turn out to be the end of the call object rather than arguments: trailing
# whitespace, the object's closing brace, and a start of the closing tag.
CALL_TAIL = re.compile(r"\s*\}?\s*(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l(?:>)?)?)?)?)?)?)?)?)?)?)?)?$")


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the message's tool_calls
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""  # a piece of the arguments' JSON text


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """One completion's calls. With `parallel` false, blocks after the first call are dropped."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls = 0  # calls started so far
        self.in_call = False
        self.block = ""  # the current block's text after <tool_call>
        self.head_end = 0  # where the arguments start in `block`, once the head is read (0: not yet)
        self.sent = 0  # how much of `block` went out as arguments
        self.pending = ""  # outside a block: a possible tag start, or whitespace that may precede a call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) of `text`; at `final` everything held is released."""
        content, deltas = "", []
        buffer, self.pending = self.pending + text, ""
        while True:
            if self.in_call:
                # The closing tag may arrive split across pieces: look for it in the whole block.
                searched_from = max(0, len(self.block) - len(CALL_END) + 1)
                self.block += buffer
                end = self.block.find(CALL_END, searched_from)
                if end < 0:
                    deltas += self._stream_arguments()
                    break
                self.block, buffer = self.block[:end], self.block[end + len(CALL_END):]
                deltas += self._stream_arguments()  # a block that came whole reads as a streamed one would
                text_out, closed = self._close_call()
                content += text_out
                deltas += closed
                continue
            start = buffer.find(CALL_START)
            if start >= 0:
                content += buffer[:start].rstrip()  # the line break before a call is layout, not content
                buffer = buffer[start + len(CALL_START):]
                self.in_call, self.block, self.head_end, self.sent = True, "", 0, 0
                continue
            # Held: a possible start of <tool_call>, and trailing whitespace, which may come before one.
            held = held_tag_prefix(buffer, CALL_START)
            shown = buffer[:len(buffer) - held].rstrip()
            content += shown
            self.pending = buffer[len(shown):]
            break
        if final:
            if self.in_call:  # cut off inside a call: close it with what was written
                deltas += self._stream_arguments()
                text_out, closed = self._close_call()
                content += text_out
                deltas += closed
            if self.pending.strip() or not self.calls:  # whitespace after the last call is layout too
                content += self.pending
            self.pending = ""
        return content, deltas

    def _dropping(self) -> bool:
        return not self.parallel and self.calls >= 1 and not self.head_end

    def _stream_arguments(self) -> list[ToolCallDelta]:
        deltas = []
        if not self.head_end and not self._dropping():
            head = CALL_HEAD.match(self.block)
            if head is not None:
                self.head_end = self.sent = head.end()
                name = json.loads(f'"{head.group(1)}"')
                deltas.append(ToolCallDelta(self.calls, new_call_id(), name))
                self.calls += 1
        if self.head_end:
            safe = CALL_TAIL.search(self.block, self.sent).start()
            if safe > self.sent:
                deltas.append(ToolCallDelta(self.calls - 1, arguments=self.block[self.sent:safe]))
                self.sent = safe
        return deltas

    def _close_call(self) -> tuple[str, list[ToolCallDelta]]:
        """The block is complete: (content, deltas) that finish it."""
        block, streamed = self.block, bool(self.head_end)
        self.in_call, self.block, self.head_end = False, "", 0
        if streamed:
            arguments = block[self.sent:].rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
            return "", [ToolCallDelta(self.calls - 1, arguments=arguments)] if arguments else []
        if not self.parallel and self.calls >= 1:
            return "", []
        try:
            call = json.loads(block)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            return CALL_START + block + CALL_END, []  # not a call after all: the model's text, as written
        self.calls += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return "", [ToolCallDelta(self.calls - 1, new_call_id(), name, text)]
