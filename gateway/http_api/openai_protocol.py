"""OpenAI request bodies (completions and chat) and their translation into GenerationRequests."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.core.tools import ToolCall
from gateway.core.validation import MAX_SEED, GenerationRequest
from rpcserver.errors import InvalidArgument

MAX_N = 16  # choices per request: each one is a sequence on the worker
# Prompts in one completions request (lm-evaluation-harness batches its scoring requests); each
# prompt's n choices are sequences on the worker.
MAX_PROMPTS = 256


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far, not only the last one.
    continuous_usage_stats: bool = False


# Unknown top-level fields that only label or log a request: accepted and ignored, as OpenAI clients send
# them. Any other unknown field might change the output, so it is refused rather than ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prediction", "stream_options"})
# vLLM's keys in `structured_outputs` that pick the form; exactly one is given.
STRUCTURED_FORMS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
# vLLM's older top-level spellings of the same forms.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _Common(BaseModel):
    # Unknown fields are kept so that refuse_unknown_fields can name them.
    model_config = ConfigDict(extra="allow")

    model: str = ""
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = Field(default_factory=list)
    # Structured output: OpenAI's spelling, then vLLM's (current and older).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's and vLLM's default for completions; an explicit null means up to the context, as in vLLM.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it; some clients send the object


class ChatToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[ChatToolCall] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages (with tools) rendered as /v1/chat/completions does."""
    model_config = ConfigDict(extra="allow")

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids -> text (special tokens kept)."""
    model_config = ConfigDict(extra="allow")

    model: str = ""
    tokens: list[int]


# Every top-level field of a request body: an error message that starts with one names it.
FIELD_NAMES = (frozenset(CompletionRequest.model_fields) | frozenset(ChatRequest.model_fields)
               | frozenset(TokenizeRequest.model_fields) | frozenset(DetokenizeRequest.model_fields))


# Over this size a body is parsed, and made into requests, on a thread. A megabyte of tools is tens of
# milliseconds of Python objects, more with the collections they set off; on the loop that time would be every
# other stream's too. On a thread it still holds the GIL inside each C call, but the loop gets it between them.
LARGE_BODY_BYTES = 64 * 1024


async def off_loop(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args): at once for a body of `size` bytes up to LARGE_BODY_BYTES, on a thread past it (the thread hop
    costs more than a small body's parse)."""
    if size <= LARGE_BODY_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """parse(), off the event loop for a large body."""
    return await off_loop(len(body), parse, model, body)


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`; a body that does not fit becomes InvalidArgument naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise InvalidArgument(_first_error(model, e.errors())) from None


def _first_error(model: type[BaseModel], errors: list[dict]) -> str:
    """The first field that does not fit, as the body spells it (`messages[0].content`).

    A field that takes several types fails once per type, each under pydantic's name for the type
    (`prompt.str`, `prompt.list[int]`): those names stay out, and the error that got furthest wins.
    """
    first = errors[0]
    union = next(((i, annotation) for i, (_, annotation, is_member) in enumerate(_steps(model, first["loc"]))
                  if is_member), None)
    if union is None:
        return f"{_where(model, first['loc'])}: {first['msg']}"
    at, annotation = union
    prefix = first["loc"][:at]
    deepest = max((e for e in errors if e["loc"][:at] == prefix and len(e["loc"]) > at), key=lambda e: len(e["loc"]))
    if len(deepest["loc"]) == at + 1:  # no type got past the value itself: say which ones the field takes
        return f"{_where(model, prefix)}: expected {' or '.join(_kinds(annotation))}"
    return f"{_where(model, deepest['loc'])}: {deepest['msg']}"


def _steps(model: type[BaseModel], loc: tuple) -> Iterator[tuple[Any, Any, bool]]:
    """Each part of pydantic's location, the type it indexes into, and whether it names a union's member."""
    annotation = model
    for part in loc:
        members = [a for a in get_args(annotation) if a is not type(None)] if _is_union(annotation) else []
        if len(members) > 1:
            yield part, annotation, True
            annotation = None  # which member failed does not change how the rest of the location reads
            continue
        if members:  # X | None: pydantic names no member
            annotation = members[0]
        yield part, annotation, False
        annotation = _inner(annotation, part)


def _where(model: type[BaseModel], loc: tuple) -> str:
    where = ""
    for part, annotation, is_member in _steps(model, loc):
        if is_member:
            continue
        if isinstance(part, int):
            where += f"[{part}]"
        elif get_origin(annotation) is dict:
            where += f'["{part}"]'
        else:
            where += f".{part}" if where else part
    return where or "body"


def _inner(annotation: Any, part: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(part)
        return field.annotation if field else None
    args = get_args(annotation)
    return args[-1] if args else None  # list[X] -> X, dict[K, V] -> V


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType)


def _kinds(union: Any) -> list[str]:
    """What a union field takes, in words: ["a string", "a list"]."""
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
             dict: "an object"}
    kinds = []
    for member in get_args(union):
        kind = words.get(get_origin(member) or member, "an object")
        if member is not type(None) and kind not in kinds:
            kinds.append(kind)
    return kinds


def completion_requests(body: CompletionRequest) -> list[GenerationRequest]:
    """One request per prompt: a string, a list of token ids, or a list of either.

    With `echo`, each choice's text starts with its prompt and, with `logprobs`, its logprobs start
    with the prompt tokens' (the first one null), as OpenAI's legacy completions did.
    """
    prompts = _prompts(body.prompt)
    if body.suffix:
        raise InvalidArgument("suffix is not supported")
    if body.best_of not in (None, body.n):
        raise InvalidArgument("best_of is not supported (leave it unset or equal to n)")
    requests = []
    for prompt in prompts:
        req = GenerationRequest(max_tokens=body.max_tokens, logprobs=body.logprobs, echo=body.echo,
                                prompt_logprobs=body.logprobs if body.echo else None,
                                field_names={"prompt_logprobs": "logprobs"})
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids = prompt
        requests.append(_common(body, req))
    return requests


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidArgument("prompt is an empty list; give a string, token ids, or a list of either")
    if isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidArgument(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed")
    for p, ids in enumerate(prompt):
        if isinstance(ids, list):
            if not ids:
                raise InvalidArgument(f"prompt[{p}] is an empty list of token ids; give at least one")
            negative = next((i for i, t in enumerate(ids) if t < 0), None)
            if negative is not None:
                raise InvalidArgument(f"prompt[{p}][{negative}] is {ids[negative]}, not a token id")
    return list(prompt)


def chat_request(body: ChatRequest) -> GenerationRequest:
    messages, message_tool_calls, tool_call_ids = [], {}, {}
    for i, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
        messages.append((role, _text(message, i)))
        if message.tool_calls:
            if role != "assistant":
                raise InvalidArgument(f"messages[{i}].tool_calls: only assistant messages make tool calls")
            message_tool_calls[i] = [_past_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            tool_call_ids[i] = message.tool_call_id
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs: true")
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = kwargs.pop("enable_thinking", None)
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidArgument("chat_template_kwargs.enable_thinking must be true or false")
    if kwargs:
        raise InvalidArgument(f"chat_template_kwargs supports only enable_thinking, got {', '.join(kwargs)}")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidArgument("give max_completion_tokens or max_tokens, not both")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # Chat's count of top logprobs is its top_logprobs (its `logprobs` is a switch), and its max_tokens may be
    # spelled max_completion_tokens: errors name the field the caller sent.
    field_names = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        field_names["max_tokens"] = "max_completion_tokens"
    return _common(body, GenerationRequest(
        messages=messages, enable_thinking=thinking, max_tokens=max_tokens, logprobs=logprobs,
        tools=[json.dumps(tool, ensure_ascii=False) for tool in body.tools or []],
        tool_choice=_tool_choice(body), parallel_tool_calls=body.parallel_tool_calls,
        message_tool_calls=message_tool_calls, tool_call_ids=tool_call_ids, field_names=field_names))


def _tool_choice(body: ChatRequest) -> str:
    """OpenAI's tool_choice as the core's string: auto, none, required or a function's name."""
    choice = body.tool_choice
    if choice is None:
        return "auto"  # OpenAI's default with tools; without any, nothing is offered either way
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise InvalidArgument('tool_choice must be "auto", "none", "required" or '
                                  '{"type": "function", "function": {"name": ...}}')
        return function["name"]
    if choice not in ("auto", "none", "required"):
        raise InvalidArgument(f'tool_choice must be "auto", "none", "required" or a function object, got {choice!r}')
    return choice


def _past_call(call: ChatToolCall) -> ToolCall:
    arguments = call.function.arguments
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call.id, call.function.name, arguments)


def choice_requests(req: GenerationRequest, n: int) -> list[GenerationRequest]:
    """One request per choice; with a seed, choice i samples with seed + i so the choices differ."""
    requests = [req]
    for i in range(1, n):
        seed = None if req.seed is None else (req.seed + i) % (MAX_SEED + 1)
        requests.append(GenerationRequest(**{**req.__dict__, "seed": seed, "stop": list(req.stop)}))
    return requests


def _common(body: _Common, req: GenerationRequest) -> GenerationRequest:
    refuse_unknown_fields(body)
    req.structured_output = structured_output(body)
    if not 1 <= body.n <= MAX_N:
        raise InvalidArgument(f"n must be in [1, {MAX_N}], got {body.n}")
    req.logit_bias = _logit_bias(body.logit_bias or {})
    req.stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for name in ("seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty"):
        setattr(req, name, getattr(body, name))
    req.ignore_eos = body.ignore_eos
    req.skip_special_tokens = body.skip_special_tokens
    req.stop_token_ids = list(body.stop_token_ids)
    return req


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias: JSON object keys are strings holding token ids."""
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidArgument(f"logit_bias key {key!r} is not a token id") from None
        bias[token_id] = value
    return bias


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidArgument(f"messages[{index}].content: only text parts are supported, got {part.type!r}")
        parts.append(part.text)
    return "".join(parts)



class UnknownField(InvalidArgument):
    """A field this server does not know; `param` names it for the error object."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def refuse_unknown_fields(body: BaseModel) -> None:
    unknown = sorted(set(body.model_extra or ()) - IGNORED_FIELDS)
    if unknown:
        raise UnknownField(f"{unknown[0]} is not a supported field (it would change the output, so it is "
                              f"refused rather than ignored)", unknown[0])


def structured_output(body: _Common) -> tuple[str, object] | None:
    """The one structured-output constraint the body asks for, from whichever spelling it uses."""
    given = []
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        given.append(("response_format", _response_format(body.response_format)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    for name, key in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            given.append((name, _form(name, key, value)))
    if len(given) > 1:
        raise InvalidArgument(f"{given[1][0]}: give one structured-output constraint, not both "
                              f"{given[0][0]} and {given[1][0]}")
    return given[0][1] if given else None


def _response_format(value: dict) -> tuple[str, object]:
    kind = value.get("type")
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidArgument("response_format.json_schema must be an object with a `schema` object")
        # OpenAI's `name`, `description` and `strict` describe the schema; the output always follows it.
        return "json_schema", json.dumps(spec.get("schema", {}))
    raise InvalidArgument(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(value: dict) -> tuple[str, object]:
    forms = [k for k in value if k in STRUCTURED_FORMS and value[k] not in (None, False)]
    # vLLM's fine-tuning switches; this engine's JSON is always compact, so these change nothing here.
    others = sorted(set(value) - set(STRUCTURED_FORMS) - {"disable_any_whitespace", "disable_fallback",
                                                           "disable_additional_properties"})
    if others:
        raise InvalidArgument(f"structured_outputs.{others[0]} is not supported; give one of "
                              f"{', '.join(STRUCTURED_FORMS)}")
    if len(forms) != 1:
        raise InvalidArgument(f"structured_outputs must hold exactly one of {', '.join(STRUCTURED_FORMS)}")
    return _form(f"structured_outputs.{forms[0]}", forms[0], value[forms[0]])


def _form(name: str, key: str, value: Any) -> tuple[str, object]:
    kind = STRUCTURED_FORMS[key]
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(f"{name} must be true")
        return kind, True
    if kind == "json_schema":
        if isinstance(value, dict):
            return kind, json.dumps(value)
        if isinstance(value, str):
            return kind, value
        raise InvalidArgument(f"{name} must be a JSON schema (an object or its JSON text)")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidArgument(f"{name} must be a list of non-empty strings")
        return kind, list(value)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string")
    return kind, value
