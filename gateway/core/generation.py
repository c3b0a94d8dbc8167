"""The gateway's generation core: request -> encode -> worker stream -> text -> stop strings -> deltas.

Plain Python over the downstreams object; the gRPC servicer and the HTTP front both adapt it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from gateway.core.deltas import Delta, PromptLogprob, TokenLogprob, piece_ids, step_logprobs
from gateway.core.metrics import RequestRecord
from gateway.core.pacing import MessagePacing
from gateway.core.request_id import new_request_id
from gateway.core.tools import forced_call_constraint, is_forced, offered_tools, tool_call_grammar
from gateway.core.validation import (
    GenerationRequest,
    Limits,
    RequestLimits,
    check_for_worker,
    check_prompt_length,
    check_request,
)
from gateway.text.chat_output import ChatOutput
from gateway.text.reasoning_parser import THINK_END, ReasoningParser, prompt_opens_reasoning
from gateway.text.stop import StopStringMatcher
from gateway.text.detokenize import TextStream
from gateway.text.tool_parser import ToolCallParser
from rpcserver.errors import InvalidArgument, Unavailable
from rpcserver.shared import SAMPLING_FIELDS
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

FINISH_REASONS = {worker_pb2.FINISH_REASON_EOS: "eos", worker_pb2.FINISH_REASON_LENGTH: "length"}


class SharedEncodes:
    """One HTTP request's Encode calls: each distinct prompt is encoded once, for all its choices and repeats."""

    def __init__(self):
        self._calls: dict[bytes, asyncio.Future] = {}

    def prompt(self) -> PromptEncode:
        """The encode shared by one prompt's choices."""
        return PromptEncode(self)

    def call(self, tokenizer, request: tokenizer_pb2.EncodeRequest, timeout: float | None) -> asyncio.Future:
        # The same message gets the same ids: the message itself is the key.
        key = request.SerializeToString(deterministic=True)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = asyncio.ensure_future(tokenizer.Encode(request, timeout=timeout))
            # Read its outcome even when every choice waiting on it has gone, so asyncio does not report it.
            call.add_done_callback(lambda done: done.cancelled() or done.exception())
        return call


class PromptEncode:
    """One prompt's Encode, for each of its choices. The first builds the message and looks it up among the
    request's others (a repeated prompt); the rest take its call as it is. Building and serializing a
    megabyte-long prompt's message once per choice held the event loop tens of milliseconds for n = 8."""

    def __init__(self, shared: SharedEncodes):
        self.shared = shared
        self._call: asyncio.Future | None = None

    async def encode(self, tokenizer, build: Callable[[], tokenizer_pb2.EncodeRequest],
                     timeout: float | None) -> tokenizer_pb2.EncodeResponse:
        if self._call is None:
            self._call = self.shared.call(tokenizer, build(), timeout)
        # One choice cancelled (a stop string, its error) leaves the call running for the others.
        return await asyncio.shield(self._call)


class GenerationCore:
    """Runs one request at a time per call of `generate`, any number concurrently.

    Tokens that came while a request's reader was busy (its client slow, or tokens faster than a
    message per token can go out) are handled together and go out as one delta; `stream_interval`
    > 1 also holds tokens back until that many are ready (the first and last tokens never wait).
    `message_rate` > 0 paces the streams under load (`MessagePacing`): each waits its share of that
    many messages a second before it takes its next tokens.
    """

    def __init__(self, downstreams, limits_overrides: dict, stream_interval: int = 1, adapters=None,
                 message_rate: float = 0):
        self.downstreams = downstreams  # Downstreams, or any object with the same surface
        self.limits_overrides = limits_overrides
        self.stream_interval = stream_interval
        self.pacing = MessagePacing(message_rate)
        self.adapters = adapters  # the fleet's LoRA adapters (fleet.adapters.Adapters); None: none are served

    def check_adapter(self, adapter: str) -> None:
        """Refuses a LoRA adapter no worker serves (INVALID_ARGUMENT); "" is the base model."""
        if not adapter:
            return
        if self.adapters is None:
            raise InvalidArgument(f"adapter {adapter!r} is not served: this gateway serves no LoRA adapters")
        self.adapters.check(adapter)

    def limits(self) -> Limits:
        info = self.downstreams.worker_info
        if info is None:
            raise Unavailable("the model worker has not answered yet; retry shortly")
        return Limits.for_worker(info, **self.limits_overrides)

    def check(self, req: GenerationRequest) -> None:
        """Refuses a request invalid on its face, before anything waits on the tokenizer or a worker: it gets
        its INVALID_ARGUMENT even while no worker serves."""
        check_request(req, RequestLimits.from_overrides(self.limits_overrides))

    async def encode(self, req: GenerationRequest, timeout: float | None, add_generation_prompt: bool = True,
                     add_special_tokens: bool = False,
                     encodes: PromptEncode | None = None) -> tuple[Sequence[int], str]:
        """(prompt ids, the rendered chat prompt or ""); with `encodes`, a prompt already encoded there is reused.

        The ids stay in the reply's own container: an over-long prompt is refused by its length, before
        hundreds of thousands of them are copied into a list on the event loop (once per choice)."""
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids, ""

        def build() -> tokenizer_pb2.EncodeRequest:
            encode = tokenizer_pb2.EncodeRequest(add_generation_prompt=add_generation_prompt,
                                                 add_special_tokens=add_special_tokens)
            if req.messages is not None:
                encode.messages.extend(chat_message(req, i) for i in range(len(req.messages)))
                encode.tools.extend(offered_tools(req.tools, req.tool_choice))
                if req.enable_thinking is not None:
                    encode.enable_thinking = req.enable_thinking
            else:
                encode.text = req.prompt
            return encode

        if encodes is not None:
            reply = await encodes.encode(self.downstreams.tokenizer, build, timeout)
        else:
            reply = await self.downstreams.tokenizer.Encode(build(), timeout=timeout)
        return reply.token_ids, reply.rendered

    async def generate(self, req: GenerationRequest, record: RequestRecord, timeout=lambda: None,
                       with_pieces: bool = False, encodes: PromptEncode | None = None) -> AsyncIterator[Delta]:
        """Deltas of one request; the last has `finish_reason`. Leaving early cancels the worker's sequence.

        `timeout()` gives the seconds left for the request (None: no deadline); `with_pieces`
        adds each logprob token's raw bytes (the OpenAI shapes need token strings); `encodes` shares
        one Encode call among the choices of one prompt, and among the repeats of it in one HTTP request.
        """
        self.check(req)
        constraint = forced_call_constraint(req.tools, req.tool_choice)
        if constraint is not None and req.structured_output is not None:
            raise InvalidArgument('tool_choice "required" or a named function already constrains the output; '
                                  "leave out response_format and structured_outputs")
        limits = self.limits()
        check_for_worker(req, limits)
        self.check_adapter(req.adapter)
        prompt_ids, rendered = await self.encode(req, timeout(), encodes=encodes)
        record.prompt_tokens = len(prompt_ids)
        # Callers choose their ids freely and may reuse one; the worker needs each open request's id to be
        # unique, so it gets the gateway's own.
        record.worker_request_id = new_request_id()
        max_tokens = check_prompt_length(len(prompt_ids), req.max_tokens, limits, req.name_of("max_tokens"))
        prompt_ids = list(prompt_ids)  # within the context now
        # max_tokens 0 scores the prompt: the worker runs its prefill and one token, which is dropped here.
        work = worker_request(req, prompt_ids, max(max_tokens, 1), record.worker_request_id)
        if constraint is not None or work.HasField("structured_output"):
            # As in vLLM with a reasoning parser: in a chat that thinks, the model reasons freely and the
            # constraint (a structured output, or the forced calls) holds from the end of its think block.
            think_end = self._think_end() if reasoning_comes_first(req, rendered) else None
            if constraint is not None:
                constrain(work, req, constraint, after_reasoning=think_end is not None)
            if think_end is not None:
                work.structured_output.start_after_token_id = think_end

        stops = StopStringMatcher(req.stop)
        output = chat_output(req, rendered)
        constrained = req.structured_output is not None or constraint is not None
        stream = self.downstreams.open_worker_stream(work, timeout())
        pacing = self.pacing
        pacing.opened()
        text = None
        worker_finished = False
        first = True
        held: Delta | None = None  # tokens waiting for --stream-interval's count
        try:
            text = self.downstreams.detokenizer.open(req.skip_special_tokens)
            async for steps in stream.batches():
                if first:
                    first = False
                    prompt_logprobs, prompt_text = await self._prompt_extras(req, prompt_ids, steps[0], with_pieces)
                    if max_tokens == 0:
                        record.finish_reason = "length"
                        yield Delta(text="", token_ids=[], finish_reason="length", prompt_tokens=len(prompt_ids),
                                    time_to_first_token_s=record.ttft, prompt_logprobs=prompt_logprobs,
                                    prompt_text=prompt_text)
                        return  # the cancel below drops the worker's sequence, if it has not ended already
                pieces_wanted = with_pieces and req.logprobs is not None
                steps, shown, pieces, matched = await decoded(steps, text, stops, pieces_wanted)
                last = steps[-1]
                final = bool(last.finish_reason)
                record.add_tokens(len(steps))
                for step in steps:
                    if step.HasField("spec_accepted"):
                        record.spec_steps += 1
                        record.spec_accepted += step.spec_accepted
                delta = Delta(text=shown, token_ids=[step.token_id for step in steps], prompt_tokens=len(prompt_ids),
                              completion_tokens=record.completion_tokens)
                if req.logprobs is not None:
                    delta.logprobs = step_logprobs(steps, pieces)
                if prompt_logprobs is not None or prompt_text is not None:
                    delta.prompt_logprobs, delta.prompt_text = prompt_logprobs, prompt_text
                    prompt_logprobs = prompt_text = None
                if matched is not None:
                    delta.finish_reason, delta.stop_reason = "stop", matched
                elif final:
                    delta.finish_reason = FINISH_REASONS[last.finish_reason]
                    # A grammar that completes ends the sequence on its own last token: no stop reason to give.
                    grammar_done = constrained and not _is_stop_id(last.token_id, req, self.downstreams)
                    if delta.finish_reason == "eos" and not grammar_done:
                        delta.stop_reason = self.downstreams.token_text.get(last.token_id, str(last.token_id))
                    delta.text += stops.flush()
                if output is not None:
                    delta.reasoning_text, delta.text, delta.tool_calls = output.feed(
                        delta.text, final=bool(delta.finish_reason))
                if held is not None:
                    delta.follow(held)
                    held = None
                if delta.finish_reason:
                    delta.called_tools = output is not None and output.called_tools
                    delta.time_to_first_token_s = record.ttft
                    record.finish_reason = delta.finish_reason
                    yield delta
                    if matched is not None:
                        return  # the worker is still generating: the cancel below stops it
                    # Read the worker's stream to its end, so its call completes OK rather than cancelled.
                    worker_finished = True
                    continue
                if len(delta.token_ids) < self.stream_interval and not delta.has_first_token:
                    held = delta
                    continue
                yield delta
                at = pacing.next_message_at(asyncio.get_running_loop().time())
                if at is not None:
                    stream.hold(at)
            if not worker_finished:
                raise Unavailable("the model worker ended the stream without a finish reason")
        finally:
            pacing.closed()
            if not worker_finished:
                stream.cancel()  # frees the worker's sequence on a stop string, an error or a client cancel
            if text is not None:
                text.cancel()  # a no-op once its final ids went out

    def _think_end(self) -> int | None:
        """The id of the token that ends a think block (`</think>`), when the served tokenizer has one."""
        return next((i for i, text in self.downstreams.token_text.items() if text == THINK_END), None)

    async def _prompt_extras(self, req: GenerationRequest, prompt_ids: list[int], step: worker_pb2.GenerateResponse,
                             with_pieces: bool) -> tuple[list[PromptLogprob] | None, str | None]:
        """The prompt's logprobs (from the worker's first step) and, for echo, its text; pieces when asked for.

        A long prompt's logprobs are tens of thousands of entries: they are read on a thread, so the event
        loop serves every other stream meanwhile.
        """
        scored = step.prompt_logprobs if req.prompt_logprobs is not None else None
        if scored is not None and len(scored) != len(prompt_ids):
            raise Unavailable(f"the model worker sent {len(scored)} prompt logprobs for {len(prompt_ids)} prompt tokens")
        prompt_text, pieces = None, []
        wanted = await asyncio.to_thread(_prompt_piece_ids, prompt_ids, scored) \
            if scored is not None and with_pieces else []
        if req.echo or wanted:
            # One decode of the whole prompt gives its text and every token's bytes; special tokens are kept,
            # as they are part of what was scored.
            stream = self.downstreams.detokenizer.open(False)
            whole, pieces = await stream.add(prompt_ids, True, wanted)
            prompt_text = req.prompt if req.prompt is not None else whole
        if scored is None:
            return None, prompt_text if req.echo else None
        return await asyncio.to_thread(_prompt_logprobs, prompt_ids, scored, pieces), prompt_text if req.echo else None


def reasoning_comes_first(req: GenerationRequest, rendered_prompt: str) -> bool:
    """A chat whose prompt leaves thinking to the model (Qwen3's think block not closed in the prompt)."""
    return req.messages is not None and not rendered_prompt.rstrip().endswith(THINK_END)


def chat_output(req: GenerationRequest, rendered_prompt: str) -> ChatOutput | None:
    """The parsers for a chat's output (reasoning always, tool calls when tools are offered); None for a prompt."""
    if req.messages is None:
        return None
    offered = offered_tools(req.tools, req.tool_choice)
    tools = ToolCallParser(req.parallel_tool_calls, is_forced(req.tool_choice)) if offered else None
    return ChatOutput(ReasoningParser(prompt_opens_reasoning(rendered_prompt)), tools)


def chat_message(req: GenerationRequest, index: int) -> tokenizer_pb2.ChatMessage:
    role, content = req.messages[index]
    return tokenizer_pb2.ChatMessage(
        role=role, content=content, tool_call_id=req.tool_call_ids.get(index, ""),
        tool_calls=[tokenizer_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                    for c in req.message_tool_calls.get(index, [])])


def constrain(work: worker_pb2.GenerateRequest, req: GenerationRequest, constraint: dict,
              after_reasoning: bool = False) -> None:
    """A forced tool call ("required" or a named function): the worker's grammar engine admits only
    `<tool_call>` blocks whose JSON is a call of an allowed tool with valid arguments (a structured output
    beside it is refused before the request reaches a worker). `after_reasoning`: the grammar starts
    right after the model's `</think>`, not at its first token."""
    work.structured_output.grammar = tool_call_grammar(constraint, req.parallel_tool_calls, after_reasoning)


def worker_request(req: GenerationRequest, prompt_ids: list[int], max_tokens: int,
                   request_id: str) -> worker_pb2.GenerateRequest:
    work = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
                                      stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                                      adapter=req.adapter)
    for name in SAMPLING_FIELDS:
        if getattr(req, name) is not None:
            setattr(work.sampling, name, getattr(req, name))
    if req.logprobs is not None:
        work.logprobs = req.logprobs
    if req.prompt_logprobs is not None:
        work.prompt_logprobs = req.prompt_logprobs
    work.logit_bias.update(req.logit_bias)
    if req.structured_output is not None:
        kind, value = req.structured_output
        if kind == "choice":
            work.structured_output.choice.choices.extend(value)
        else:
            setattr(work.structured_output, kind, value)
    return work


def _is_stop_id(token_id: int, req: GenerationRequest, downstreams) -> bool:
    """Whether an "eos" finish came from an eos or stop token id, not a completed structured output."""
    info = downstreams.worker_info
    return token_id in req.stop_token_ids or (info is not None and token_id in info.eos_token_ids)


def _prompt_piece_ids(prompt_ids: list[int], scored) -> list[int]:
    """Each prompt token's id, then its position's candidates' ids: the ids whose bytes the OpenAI shapes need."""
    return [t for t, s in zip(prompt_ids, scored) for t in (t, *(x.token_id for x in s.top))]


def _prompt_logprobs(prompt_ids: list[int], scored, pieces: list[bytes]) -> list[PromptLogprob]:
    """The worker's prompt logprobs as the core's objects, with each token's bytes when `pieces` has them."""
    out, at = [], 0
    for token_id, entry in zip(prompt_ids, scored):
        ids = [token_id, *(t.token_id for t in entry.top)]
        got = pieces[at:at + len(ids)] if pieces else [None] * len(ids)
        at += len(ids) if pieces else 0
        logprob = entry.logprob if entry.HasField("logprob") else None
        out.append(PromptLogprob(TokenLogprob(token_id, logprob, got[0]),
                                 [TokenLogprob(t.token_id, t.logprob, p) for t, p in zip(entry.top, got[1:])]))
    return out


async def decoded(steps: list[worker_pb2.GenerateResponse], text: TextStream, stops: StopStringMatcher,
                  with_pieces: bool) -> tuple[list[worker_pb2.GenerateResponse], str, list[bytes], str | None]:
    """(the steps, their text safe to show, their logprob tokens' bytes, the stop string matched or None).

    With stop strings, several steps are decoded one text per token, so a stop string completed by one
    of them cuts the steps there: the tokens, logprobs and counts are the ones a message per token gives.
    """
    ids = [step.token_id for step in steps]
    final = bool(steps[-1].finish_reason)
    wanted = piece_ids(steps) if with_pieces else []
    if not stops.has_stops or len(ids) == 1:
        new_text, pieces = await text.add(ids, final, wanted)
        shown, matched = stops.feed(new_text)
        return steps, shown, pieces, matched
    texts, pieces = await text.add_each(ids, final, wanted)
    parts, matched = [], None
    for count, token_text in enumerate(texts, 1):
        part, matched = stops.feed(token_text)
        parts.append(part)
        if matched is not None:
            return steps[:count], "".join(parts), pieces, matched
    return steps, "".join(parts), pieces, None
