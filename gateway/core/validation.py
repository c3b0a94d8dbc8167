"""The gateway's request object and the checks it must pass before any work is done."""

import functools
import logging
import math
from dataclasses import dataclass, field, fields

from gateway.core.request_id import check_request_id
from gateway.core.tools import ToolCall, check_tools, is_forced
from rpcserver.errors import InvalidArgument
from rpcserver.shared import MAX_SEED

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """The gateway's own bounds, known before any worker answers: a request is checked against them first."""

    max_stop_strings: int = 8
    max_stop_string_chars: int = 128
    max_logprobs: int = 20
    max_prompt_chars: int = 1_000_000  # the prompt, or a chat's contents, tools and past calls
    max_messages: int = 512

    @classmethod
    def from_overrides(cls, overrides: dict) -> "RequestLimits":
        """Those of the gateway's limit flags (`overrides`, as Limits.for_worker takes them) that need no worker."""
        names = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in overrides.items() if name in names})


@dataclass(frozen=True, kw_only=True)
class Limits(RequestLimits):
    """What the gateway accepts once a worker has answered; the None defaults are resolved from max_context."""

    max_context: int
    max_prompt_tokens: int | None = None  # None: max_context - 1, leaving room for one token
    max_tokens_limit: int | None = None  # None: max_context
    vocab_size: int = 0  # the worker's; 0: unknown (token ids are then checked by the worker alone)

    @classmethod
    def for_worker(cls, info, **overrides) -> "Limits":
        """Limits for a worker's GetInfo: its context, and top logprobs capped at what it serves."""
        if info.max_logprobs:  # 0: a worker that does not say
            overrides["max_logprobs"] = min(overrides.get("max_logprobs", cls.max_logprobs), info.max_logprobs)
        # A flag set beyond the worker's context (known only once it answers) is capped there, not
        # turned into a failure of every request.
        for name, ceiling in (("max_prompt_tokens", info.max_context - 1), ("max_tokens_limit", info.max_context)):
            if overrides.get(name) is not None and overrides[name] > ceiling:
                _warn_capped(name, overrides[name], ceiling)
                overrides[name] = ceiling
        return cls(max_context=info.max_context, vocab_size=info.vocab_size, **overrides)

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        # Frozen, so the resolved defaults are written past __setattr__, once, here.
        if self.max_prompt_tokens is None:
            object.__setattr__(self, "max_prompt_tokens", self.max_context - 1)
        if self.max_tokens_limit is None:
            object.__setattr__(self, "max_tokens_limit", self.max_context)
        if not 1 <= self.max_prompt_tokens < self.max_context:
            raise ValueError(
                f"max_prompt_tokens must be in [1, {self.max_context - 1}], got {self.max_prompt_tokens}"
            )
        if not 1 <= self.max_tokens_limit <= self.max_context:
            raise ValueError(
                f"max_tokens_limit must be in [1, {self.max_context}], got {self.max_tokens_limit}"
            )


@functools.lru_cache(maxsize=None)
def _warn_capped(name: str, value: int, ceiling: int) -> None:
    log.warning("--%s %d is beyond what the worker's context allows; using %d", name.replace("_", "-"), value, ceiling)


@dataclass
class GenerationRequest:
    """One generation request, independent of how it arrived. None means unset."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # an already tokenized prompt (OpenAI completions)
    messages: list[tuple[str, str]] | None = None  # (role, content)
    enable_thinking: bool | None = None
    max_tokens: int | None = None
    # Sampling overrides; None takes the checkpoint's generation_config default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    # Every prompt token's logprob and this many alternatives per position, on the first delta.
    prompt_logprobs: int | None = None
    echo: bool = False  # the first delta carries the prompt's text (HTTP completions' echo)
    request_id: str = ""  # the caller's; checked by validate(), never sent to the worker
    # Tool calling (chat only): OpenAI tool objects as JSON text, and the calls and results of past turns.
    tools: list[str] = field(default_factory=list)
    tool_choice: str = "auto"  # auto, none, required, or a function's name
    parallel_tool_calls: bool = True  # false: at most one call is returned
    message_tool_calls: dict[int, list[ToolCall]] = field(default_factory=dict)  # message index -> its calls
    tool_call_ids: dict[int, str] = field(default_factory=dict)  # "tool" message index -> the call it answers
    # (kind, value): ("json_schema", JSON text), ("json_object", True), ("regex", str), ("choice", [str]),
    # ("grammar", str); compiled and checked by the worker, which enforces it at the logits.
    structured_output: tuple[str, object] | None = None
    adapter: str = ""  # the LoRA adapter to generate with, by the name the workers serve it under; "": the base model
    # The caller's names for fields it spells otherwise (chat's top_logprobs is `logprobs` here), so that
    # an error names the field that was sent.
    field_names: dict[str, str] = field(default_factory=dict)

    def name_of(self, name: str) -> str:
        return self.field_names.get(name, name)


def validate(req: GenerationRequest, limits: Limits) -> None:
    """Raises InvalidArgument naming the first field that is out of range."""
    check_request(req, limits)
    check_for_worker(req, limits)


def check_request(req: GenerationRequest, limits: RequestLimits) -> None:
    """The checks a request can fail on its face, without the tokenizer or any worker: a bad request is
    refused at once, whether or not a worker is serving."""
    check_request_id(req.request_id)
    _check_input(req, limits)
    if req.tools or is_forced(req.tool_choice):
        if req.messages is None:
            raise InvalidArgument("tools and tool_choice need messages (a chat), not a prompt")
        check_tools(req.tools, req.tool_choice)
    _check_sampling(req)
    # Its upper bound depends on the prompt's length: check_prompt_length checks it after tokenization.
    # 0 scores the prompt without generating, which only makes sense with prompt logprobs.
    scoring = req.prompt_logprobs is not None or req.echo
    if req.max_tokens is not None and req.max_tokens < (0 if scoring else 1):
        raise InvalidArgument(f"{req.name_of('max_tokens')} must be >= 1 (0 only with prompt logprobs or echo), "
                              f"got {req.max_tokens}")
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgument(
            f"stop has {len(req.stop)} strings; at most {limits.max_stop_strings} are allowed"
        )
    for i, stop in enumerate(req.stop):
        if not stop:
            raise InvalidArgument(f"stop[{i}] is empty; stop strings must have at least one character")
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidArgument(
                f"stop[{i}] is {len(stop)} characters; "
                f"at most {limits.max_stop_string_chars} are allowed"
            )
    for i, token_id in enumerate(req.stop_token_ids):
        if token_id < 0:
            raise InvalidArgument(f"stop_token_ids[{i}] must be >= 0, got {token_id}")
    _check_logprobs(req, limits)
    for token_id, value in req.logit_bias.items():
        if token_id < 0:
            raise InvalidArgument(f"logit_bias key {token_id} is not a token id")
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise InvalidArgument(f'logit_bias["{token_id}"] must be in [-100, 100], got {value:g}')


def check_for_worker(req: GenerationRequest, limits: Limits) -> None:
    """What only the worker's facts bound: token ids within its vocabulary, top logprobs within what it serves."""
    _check_logprobs(req, limits)
    vocab = limits.vocab_size
    if not vocab:
        return
    for i, token_id in enumerate(req.prompt_token_ids or ()):
        if token_id >= vocab:
            raise InvalidArgument(f"prompt[{i}] is {token_id}, not a token id of this model's vocabulary "
                                  f"[0, {vocab - 1}]")
    for token_id in req.logit_bias:
        if token_id >= vocab:
            raise InvalidArgument(f"logit_bias key {token_id} is not a token id of this model's vocabulary "
                                  f"[0, {vocab - 1}]")


def _check_logprobs(req: GenerationRequest, limits: RequestLimits) -> None:
    if req.logprobs is not None:
        _check_int_range(req.name_of("logprobs"), req.logprobs, 0, limits.max_logprobs)
    if req.prompt_logprobs is not None:
        _check_int_range(req.name_of("prompt_logprobs"), req.prompt_logprobs, 0, limits.max_logprobs)


def check_prompt_length(prompt_tokens: int, max_tokens: int | None, limits: Limits,
                        max_tokens_name: str = "max_tokens") -> int:
    """Checks the tokenized prompt against the context; returns the max_tokens to use (sent as `max_tokens_name`)."""
    if prompt_tokens <= 0:
        raise InvalidArgument("the prompt is empty after tokenization; give some text to continue")
    if prompt_tokens > limits.max_prompt_tokens:
        raise InvalidArgument(
            f"prompt is {prompt_tokens} tokens; at most {limits.max_prompt_tokens} are allowed"
        )
    allowed = min(limits.max_context - prompt_tokens, limits.max_tokens_limit)
    if max_tokens is None:
        return allowed
    if max_tokens > allowed:
        raise InvalidArgument(
            f"{max_tokens_name} must be in [1, {allowed}] for this prompt of {prompt_tokens} tokens (context "
            f"{limits.max_context} tokens, max_tokens limit {limits.max_tokens_limit}), got {max_tokens}"
        )
    return max_tokens


def _check_input(req: GenerationRequest, limits: RequestLimits) -> None:
    given = (req.prompt is not None) + (req.messages is not None) + (req.prompt_token_ids is not None)
    if given == 0:
        raise InvalidArgument("neither prompt nor messages is given: give a prompt, or messages with at least "
                              "one message")
    if given > 1:
        raise InvalidArgument("give exactly one of prompt and messages, not both")
    if req.prompt_token_ids is not None:
        if not req.prompt_token_ids:
            raise InvalidArgument("prompt is an empty list of token ids; give at least one")
        for i, token_id in enumerate(req.prompt_token_ids):
            if token_id < 0:
                raise InvalidArgument(f"prompt[{i}] is {token_id}, not a token id")
        return
    if req.prompt is not None:
        if req.prompt == "":
            raise InvalidArgument("prompt is empty; give some text to continue")
        if len(req.prompt) > limits.max_prompt_chars:
            raise InvalidArgument(
                f"prompt is {len(req.prompt)} characters; at most {limits.max_prompt_chars} are allowed"
            )
        return
    if not req.messages:
        raise InvalidArgument("messages is empty; give at least one message")
    if len(req.messages) > limits.max_messages:
        raise InvalidArgument(
            f"messages has {len(req.messages)} entries; at most {limits.max_messages} are allowed"
        )
    for i, (role, _) in enumerate(req.messages):
        if role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role is {role!r}; it must be one of {', '.join(ROLES)}"
            )
    chars = chat_chars(req)
    if chars > limits.max_prompt_chars:
        raise InvalidArgument(
            f"messages hold {chars} characters of content, tools and tool calls; at most {limits.max_prompt_chars} "
            "are allowed"
        )


def chat_chars(req: GenerationRequest) -> int:
    """The text a chat brings to its prompt: contents, the tools' JSON and past calls' names and arguments.
    Counted before anything is encoded, so an oversized chat costs no tokenizer time."""
    calls = sum(len(call.id) + len(call.name) + len(call.arguments)
                for message_calls in req.message_tool_calls.values() for call in message_calls)
    return (sum(len(content) for _, content in req.messages) + sum(len(tool) for tool in req.tools) + calls
            + sum(len(call_id) for call_id in req.tool_call_ids.values()))


def _check_sampling(req: GenerationRequest) -> None:
    # (field, low, low inclusive, high, high inclusive); a high of None means no upper bound.
    float_ranges = (
        ("temperature", 0.0, True, None, True),
        ("top_p", 0.0, False, 1.0, True),
        ("min_p", 0.0, True, 1.0, True),
        ("repetition_penalty", 0.0, False, None, True),
        ("presence_penalty", -2.0, True, 2.0, True),
        ("frequency_penalty", -2.0, True, 2.0, True),
    )
    for name, low, low_closed, high, high_closed in float_ranges:
        value = getattr(req, name)
        if value is None:
            continue
        if not math.isfinite(value):
            raise InvalidArgument(f"{name} must be a finite number, got {value:g}")
        too_low = value < low if low_closed else value <= low
        too_high = high is not None and (value > high if high_closed else value >= high)
        if too_low or too_high:
            raise InvalidArgument(
                f"{name} must be {_interval(low, low_closed, high, high_closed)}, got {value:g}"
            )
    if req.top_k is not None and req.top_k < -1:
        raise InvalidArgument(f"top_k must be >= -1 (-1 or 0 disables it), got {req.top_k}")
    if req.seed is not None:
        _check_int_range("seed", req.seed, 0, MAX_SEED)


def _check_int_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}")


def _interval(low: float, low_closed: bool, high: float | None, high_closed: bool) -> str:
    if high is None:
        return f"{'>=' if low_closed else '>'} {low:g}"
    return f"in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
