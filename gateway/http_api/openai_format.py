"""The generation core's deltas in OpenAI's response shapes: completions and chat, chunks and whole bodies."""
from __future__ import annotations

import time
import uuid

from gateway.core.deltas import Delta, Logprobs, TokenLogprob
from gateway.text.tool_parser import ToolCallDelta

# OpenAI has no separate reason for an eos token; both it and a stop string are "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def _finish_reason(delta: Delta) -> str | None:
    if delta.called_tools and delta.finish_reason in ("eos", "stop"):
        return "tool_calls"
    return FINISH_REASONS.get(delta.finish_reason)


def _call_delta(call: ToolCallDelta) -> dict:
    """One call's piece in OpenAI's stream shape: id, type and name come once, on its first piece."""
    piece: dict = {"index": call.index}
    if call.id is not None:
        piece.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
    else:
        piece["function"] = {"arguments": call.arguments}
    return piece


def _token(t: TokenLogprob) -> str:
    # A token may hold part of a UTF-8 character; its exact bytes go in `bytes` (chat).
    return (t.piece or b"").decode("utf-8", errors="replace")


def _echoed(delta: Delta) -> tuple[str, list[Logprobs]]:
    """A completions delta's text and logprobs, led by its prompt's when it echoes one."""
    if delta.prompt_text is None:
        return delta.text, delta.logprobs
    prompt = [Logprobs(p.token, p.top) for p in delta.prompt_logprobs or ()]
    return delta.prompt_text + delta.text, prompt + delta.logprobs


def _top(lp: Logprobs) -> dict | None:
    # The first prompt token has no logprob, and no alternatives either: null, as OpenAI and vLLM write it.
    return None if lp.chosen.logprob is None else {_token(t): t.logprob for t in lp.top}


def _offsets(tokens: list[str], start: int, end: int | None = None) -> list[int]:
    """Each token starts where the tokens before it end (echoed prompt tokens lead the first), capped at `end`."""
    offsets, position = [], start
    for token in tokens:
        offsets.append(position if end is None or position < end else end)
        position += len(token)
    return offsets


def _logprobs_columns(logprobs: list[Logprobs], start: int, end: int | None = None) -> dict:
    """The completions shape; each token's text is decoded once, for `tokens` and the offsets alike."""
    tokens = [_token(lp.chosen) for lp in logprobs]
    return {"tokens": tokens, "token_logprobs": [lp.chosen.logprob for lp in logprobs],
            "top_logprobs": [_top(lp) for lp in logprobs], "text_offset": _offsets(tokens, start, end)}


class ResponseFormat:
    """Builds one response's chunks or body; `chat` picks the chat.completion shapes."""

    def __init__(self, chat: bool, model: str, n: int, logprobs: bool, choices_per_prompt: int = 1):
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = [""] * n  # each choice's text so far: text offsets, and the non-streaming body
        self.token_logprobs: list[list[Logprobs]] = [[] for _ in range(n)]
        self.started = [False] * n  # chat: the first chunk of a choice carries the role
        self.last: list[Delta | None] = [None] * n  # non-streaming: each choice's last delta
        self.choices_per_prompt = choices_per_prompt  # choice p * this + i is prompt p's i-th
        self.prompt_tokens = [0] * n  # each choice's prompt: usage counts each prompt once
        self.completion_tokens = [0] * n
        self.reasoning = [""] * n  # chat, non-streaming: each choice's reasoning_content
        self.tool_calls: list[dict[int, dict]] = [{} for _ in range(n)]  # ... and its calls by index

    def chunk(self, index: int, delta: Delta) -> dict:
        """One streamed event for choice `index`."""
        choice: dict = {"index": index}
        if self.chat:
            message = {"role": "assistant"} if not self.started[index] else {}
            if delta.reasoning_text:
                message["reasoning_content"] = delta.reasoning_text
            # A cut-off mark adds nothing to a stream: the call's pieces went out as they came, and the
            # finish_reason ("length") says it is cut.
            calls = [_call_delta(call) for call in delta.tool_calls if call.cut_off is None]
            if calls:
                message["tool_calls"] = calls
            if delta.text or not (delta.reasoning_text or calls):
                message["content"] = delta.text
            choice["delta"] = message
            choice["logprobs"] = self._chat_logprobs(delta.logprobs) if self.logprobs else None
        else:
            text, logprobs = _echoed(delta)
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(index, logprobs) if self.logprobs else None
        self.started[index] = True
        self._count(index, delta)
        self.text[index] += choice.get("text", delta.text)
        choice["finish_reason"] = _finish_reason(delta)
        if delta.finish_reason:
            choice["stop_reason"] = delta.stop_reason or None
        return self._envelope([choice], chunk=True)

    def usage_chunk(self) -> dict:
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    def add(self, index: int, delta: Delta) -> None:
        """Collects a delta for the non-streaming body."""
        text, logprobs = _echoed(delta) if not self.chat else (delta.text, delta.logprobs)
        if self.logprobs:
            self.token_logprobs[index].extend(logprobs)
        self._count(index, delta)
        self.text[index] += text
        self.reasoning[index] += delta.reasoning_text
        calls = self.tool_calls[index]
        for call in delta.tool_calls:
            if call.index not in calls:
                calls[call.index] = {"id": call.id, "type": "function", "function": {"name": call.name,
                                                                                  "arguments": ""}}
            calls[call.index]["function"]["arguments"] += call.arguments
            if call.cut_off is not None:
                # As vLLM's hermes parser gives a whole response: a call that did not end is not a
                # call, and its text, as written, is content.
                del calls[call.index]
                self.text[index] += call.cut_off
        if delta.finish_reason:
            self.last[index] = delta

    def body(self) -> dict:
        choices = []
        for index, text in enumerate(self.text):
            last = self.last[index]
            choice: dict = {"index": index}
            if self.chat:
                calls = [self.tool_calls[index][i] for i in sorted(self.tool_calls[index])]
                # As OpenAI: a message that only calls tools has no content.
                choice["message"] = {"role": "assistant", "content": text if text or not calls else None,
                                     "reasoning_content": self.reasoning[index] or None}
                if calls:
                    choice["message"]["tool_calls"] = calls
                choice["logprobs"] = self._chat_logprobs(self.token_logprobs[index]) if self.logprobs else None
            else:
                choice["text"] = text
                choice["logprobs"] = (self._offsets_logprobs(self.token_logprobs[index], text)
                                      if self.logprobs else None)
            choice["finish_reason"] = _finish_reason(last)
            choice["stop_reason"] = last.stop_reason or None
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    def usage(self) -> dict:
        completion = sum(self.completion_tokens)
        prompt = sum(self.prompt_tokens[::self.choices_per_prompt])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _count(self, index: int, delta: Delta) -> None:
        self.prompt_tokens[index] = delta.prompt_tokens
        self.completion_tokens[index] = delta.completion_tokens

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _completion_logprobs(self, index: int, logprobs: list[Logprobs]) -> dict:
        # Each token starts where the text shown so far ends (text held back for a stop string
        # or a split character counts toward the token that releases it).
        return _logprobs_columns(logprobs, len(self.text[index]))

    def _offsets_logprobs(self, logprobs: list[Logprobs], text: str) -> dict:
        # Without the stream's timing, place each token at the end of the tokens before it,
        # capped at the text's length (text after a stop string is cut).
        return _logprobs_columns(logprobs, 0, len(text))

    @staticmethod
    def _chat_logprobs(logprobs: list[Logprobs]) -> dict:
        def entry(t: TokenLogprob) -> dict:
            return {"token": _token(t), "logprob": t.logprob, "bytes": list(t.piece or b"")}
        return {"content": [{**entry(lp.chosen), "top_logprobs": [entry(t) for t in lp.top]} for lp in logprobs]}
