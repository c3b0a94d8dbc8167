"""A chat completion's text split into reasoning, content and tool calls, a piece at a time."""
from __future__ import annotations

from gateway.text.reasoning_parser import ReasoningParser
from gateway.text.tool_parser import ToolCallDelta, ToolCallParser


class ChatOutput:
    """Reasoning first (Qwen3's think block), then tool calls in what remains; either may be off."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool-call deltas) of the next piece of text."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.feed(content, final)
        return reasoning, content, calls

    @property
    def called_tools(self) -> bool:
        """Whether a call was made whole: one cut off by the end of the output does not count."""
        return self.tools is not None and self.tools.finished_calls > 0
