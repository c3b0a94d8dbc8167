"""Qwen3's reasoning parser: text between <think> and </think> is reasoning, the rest is content.

Fed the completion's text a piece at a time (after stop strings), it returns each piece split into
(reasoning, content), so a stream and a whole body split the same way. As vLLM's `qwen3` parser,
the tags themselves are dropped and the text around them is kept as written.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_reasoning(rendered_prompt: str) -> bool:
    """Whether the prompt itself ends inside a think block (templates that write `<think>\\n` for the model)."""
    return rendered_prompt.rfind(THINK_START) > rendered_prompt.rfind(THINK_END)


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`: held until the next piece decides."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningParser:
    """One completion's split. The model may open a think block only at the very start (after whitespace).

    Each piece is scanned once: what is held between pieces is a tag's start (a few characters) and, at
    the start, the leading whitespace, which is kept in pieces and never rescanned.
    """

    def __init__(self, in_reasoning: bool = False):
        # "start": nothing decided yet; "reasoning": inside the think block; "content": after it, or none.
        self.state = "reasoning" if in_reasoning else "start"
        self.pending = ""  # a possible start of <think> (at the start) or of </think> (inside the block)
        self.leading_space: list[str] = []  # at the start: the whitespace before anything else

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text`; text that may be part of a tag waits for the next call or `final`."""
        reasoning = ""
        if self.state == "start":
            if not self.pending:
                opening = text.lstrip()
                self.leading_space.append(text[:len(text) - len(opening)])
            else:
                opening = self.pending + text
            if opening.startswith(THINK_START):
                self.state, text, self.pending = "reasoning", opening[len(THINK_START):], ""
                self.leading_space = []
            elif THINK_START.startswith(opening) and not final:
                self.pending = opening  # whitespace or "<thi": cannot tell yet
                return "", ""
            else:
                self.state, text, self.pending = "content", "".join(self.leading_space) + opening, ""
                self.leading_space = []
        if self.state == "reasoning":
            buffer, self.pending = self.pending + text, ""
            end = buffer.find(THINK_END)
            if end < 0:
                held = 0 if final else held_tag_prefix(buffer, THINK_END)
                self.pending = buffer[len(buffer) - held:]
                return buffer[:len(buffer) - held], ""
            reasoning, text = buffer[:end], buffer[end + len(THINK_END):]
            self.state = "content"
        return reasoning, text
