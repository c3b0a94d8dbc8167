"""What a generation streams: deltas of text and tokens, their logprobs, and how two deltas become one message."""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.text.tool_parser import ToolCallDelta
from vllm_v0.worker.v1 import worker_pb2


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    piece: bytes | None = None  # the token's raw bytes, when asked for


@dataclass
class Logprobs:
    chosen: TokenLogprob
    top: list[TokenLogprob]


@dataclass
class PromptLogprob:
    """One prompt token: its logprob (None for the first token) and its position's best alternatives."""

    token: TokenLogprob  # its logprob may be None
    top: list[TokenLogprob]


@dataclass
class Delta:
    """What one message carries: text safe to show now, the tokens it came from (one, or several when they
    came faster than messages could go out), and on the last one how it ended."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] = field(default_factory=list)  # one per token id, in order, when asked for
    finish_reason: str | None = None  # "eos", "stop" or "length" on the last delta
    stop_reason: str = ""  # the stop string or eos token text that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, counting this delta's tokens
    time_to_first_token_s: float | None = None  # on the last delta
    # Chat: the think block's text, and parsed tool calls; `text` is then the content outside both.
    reasoning_text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    called_tools: bool = False  # on the last delta: the completion made at least one tool call
    # On the first delta only: the prompt's logprobs when asked for, and its text when echoed.
    prompt_logprobs: list[PromptLogprob] | None = None
    prompt_text: str | None = None

    @property
    def has_first_token(self) -> bool:
        """Whether this delta carries the generation's first token."""
        return bool(self.token_ids) and self.completion_tokens == len(self.token_ids)

    def follow(self, earlier: Delta) -> None:
        """Put a held-back earlier delta in front of this one, so one message carries both.

        The earlier one is never a first or a last delta: its prompt extras and end facts are this one's.
        """
        self.text = earlier.text + self.text
        self.token_ids = earlier.token_ids + self.token_ids
        self.logprobs = earlier.logprobs + self.logprobs
        self.reasoning_text = earlier.reasoning_text + self.reasoning_text
        self.tool_calls = joined_calls(earlier.tool_calls + self.tool_calls)


def joined_calls(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call's arguments as one piece (a call's first piece keeps its id and name)."""
    joined: list[ToolCallDelta] = []
    for call in calls:
        last = joined[-1] if joined else None
        if (last is not None and last.index == call.index and call.id is None and call.cut_off is None
                and last.cut_off is None):
            joined[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + call.arguments)
        else:
            joined.append(call)
    return joined


def piece_ids(steps: list[worker_pb2.GenerateResponse]) -> list[int]:
    """Each logprob token's id, then its alternatives' ids, step after step: the ids whose bytes are needed."""
    return [i for step in steps if step.HasField("logprob")
            for i in (step.token_id, *(t.token_id for t in step.top_logprobs))]


def step_logprobs(steps: list[worker_pb2.GenerateResponse], pieces: list[bytes]) -> list[Logprobs]:
    """The steps' logprobs in order, with each token's bytes when `pieces` has them (as `piece_ids` lists them)."""
    out, at = [], 0
    for step in steps:
        if not step.HasField("logprob"):
            continue
        ids = [step.token_id, *(t.token_id for t in step.top_logprobs)]
        values = [step.logprob, *(t.logprob for t in step.top_logprobs)]
        got = pieces[at:at + len(ids)] if pieces else [None] * len(ids)
        at += len(ids) if pieces else 0
        chosen, *top = (TokenLogprob(i, v, p) for i, v, p in zip(ids, values, got))
        out.append(Logprobs(chosen, top))
    return out
