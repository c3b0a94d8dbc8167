"""Per-sequence sampling settings: request overrides over generation_config, and range checks."""

from __future__ import annotations

import math
import json
from dataclasses import dataclass, fields

from rpcserver.errors import InvalidArgument
from rpcserver.shared import MAX_SEED

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
# Most top logprobs per token: each costs a sort entry and a field in every streamed message.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it

# The generation_config.json keys that are sampling defaults; the file's other keys (eos_token_id,
# max_length, ...) are the engine's business. transformers' own fallbacks (top_k=50, ...) are not
# used: only values the file actually holds count.
_GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


# The forms a structured-output constraint takes; `value` is a string in each (choice: a JSON list).
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# A constraint's text is compiled in the engine core; past this it is refused before any work.
MAX_STRUCTURED_CHARS = 100_000


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: a JSON schema, any JSON object, a regex, one of several strings, or
    an EBNF/GBNF (or Lark) grammar. Compiled and enforced at the logits by executor/grammar.py."""

    kind: str
    value: str = ""
    # The constraint starts after this token is generated (Qwen3's </think>): the reasoning is free.
    start_after: int | None = None

    @classmethod
    def json_schema(cls, schema: str | dict) -> StructuredOutput:
        """The constraint for a JSON schema (a JSON string or a dict): the one tool calls reuse."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))

    def validate(self) -> None:
        """The shape only; whether the schema, regex or grammar compiles is checked where it is compiled."""
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidArgument(
                f"structured_output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.value, str):
            raise InvalidArgument(f"structured_output {self.kind} must be a string, got {self.value!r}")
        if len(self.value) > MAX_STRUCTURED_CHARS:
            raise InvalidArgument(
                f"structured_output {self.kind} is {len(self.value)} characters; "
                f"at most {MAX_STRUCTURED_CHARS} are allowed"
            )
        if self.start_after is not None and (isinstance(self.start_after, bool)
                                             or not isinstance(self.start_after, int) or self.start_after < 0):
            raise InvalidArgument(f"structured_output start_after must be a token id, got {self.start_after!r}")
        if self.kind in ("json_schema", "regex", "grammar") and not self.value:
            raise InvalidArgument(f"structured_output {self.kind} is empty")
        if self.kind == "choice":
            try:
                choices = json.loads(self.value)
            except ValueError:
                choices = None
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise InvalidArgument("structured_output choice must be a list of strings")
            if not choices or not all(choices):
                raise InvalidArgument("structured_output choice must hold at least one non-empty string")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (anything below GREEDY_TEMPERATURE) means greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens, as in transformers
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's plus the N best
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # (token id, bias) pairs added to the raw logits before penalties and sampling (OpenAI's logit_bias).
    # Pairs, not a dict: the params cross the engine-core socket as JSON, whose keys are strings.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: none; N >= 0: every prompt token's logprob (the first has none) and its position's N best.
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None  # None: free text

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.structured_output, dict):  # as it crosses the core's socket
            self.structured_output = StructuredOutput(**self.structured_output)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = tuple(self.logit_bias.items())
        self.logit_bias = tuple((t, b) for t, b in self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before choosing (penalties or a bias)."""
        return self.has_penalties or bool(self.logit_bias)

    @classmethod
    def resolve(cls, overrides: dict, defaults: dict) -> SamplingParams:
        """Fields in `overrides` (a None value counts as unset) win; the rest come from `defaults`
        (a generation_config.json dict) where it holds them, else from the dataclass.

        As in transformers, `do_sample: false` means greedy unless the request sets temperature.
        A generation_config without do_sample is not taken as greedy: its temperature (or 1.0)
        applies.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown sampling parameter(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        values = {
            name: defaults[name]
            for name in _GENERATION_CONFIG_FIELDS
            if defaults.get(name) is not None
        }
        if defaults.get("do_sample") is False:
            values["temperature"] = 0.0
        values.update({name: value for name, value in overrides.items() if value is not None})
        for name in _FLOAT_FIELDS:
            value = values.get(name)
            # JSON writes 1.0 as 1; anything that is not a number is left for validate() to reject.
            if isinstance(value, int) and not isinstance(value, bool):
                values[name] = float(value)
        return cls(**values)

    def validate(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raises InvalidArgument naming the first bad field, its value and the allowed range."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidArgument(f"{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise InvalidArgument(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature:g}"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p:g}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidArgument(f"top_k must be >= -1 (-1 or 0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p:g}")
        if self.repetition_penalty <= 0:
            raise InvalidArgument(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty:g}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {value:g}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise InvalidArgument(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= max_logprobs:
                    raise InvalidArgument(f"{name} must be in [0, {max_logprobs}], got {value}")
        for token_id, bias in self.logit_bias:
            _check_int(f"logit_bias key {token_id!r}", token_id)
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(
                    f"logit_bias key {token_id} must be in [0, {vocab_size - 1}] (the vocabulary)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise InvalidArgument(f"logit_bias[{token_id}] must be a finite number, got {bias!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidArgument(
                    f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias:g}")
        if self.structured_output is not None:
            self.structured_output.validate()
        for i, token_id in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token_id)
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(
                    f"stop_token_ids[{i}] must be in [0, {vocab_size - 1}] (the vocabulary), "
                    f"got {token_id}"
                )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
