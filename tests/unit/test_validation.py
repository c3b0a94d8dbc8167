"""Tests for request validation, the prompt-length check and the proto conversion."""

import math

import pytest

from gateway.core.request_id import caller_request_id
from gateway.core.tools import ToolCall
from gateway.core.validation import (
    GenerationRequest,
    Limits,
    RequestLimits,
    check_for_worker,
    check_prompt_length,
    check_request,
    validate,
)
from gateway.grpc_api.convert import from_proto
from rpcserver.errors import InvalidArgument
from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.worker.v1 import worker_pb2

LIMITS = Limits(max_context=4096)


def rejects(req: GenerationRequest, *words: str, limits: Limits = LIMITS) -> str:
    """Asserts validate() raises InvalidArgument whose message has every word."""
    with pytest.raises(InvalidArgument) as info:
        validate(req, limits)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def prompt(**fields) -> GenerationRequest:
    return GenerationRequest(prompt="Hello", **fields)


# --- Limits ---------------------------------------------------------------------------


def test_limits_resolve_defaults_from_max_context():
    limits = Limits(max_context=100)
    assert limits.max_prompt_tokens == 99
    assert limits.max_tokens_limit == 100


def test_limits_keep_explicit_values():
    limits = Limits(max_context=100, max_prompt_tokens=50, max_tokens_limit=20)
    assert (limits.max_prompt_tokens, limits.max_tokens_limit) == (50, 20)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_context": 1},
        {"max_context": 100, "max_prompt_tokens": 100},
        {"max_context": 100, "max_prompt_tokens": 0},
        {"max_context": 100, "max_tokens_limit": 101},
        {"max_context": 100, "max_tokens_limit": 0},
    ],
)
def test_limits_reject_impossible_configs(fields):
    with pytest.raises(ValueError):
        Limits(**fields)


# --- valid requests -------------------------------------------------------------------


def test_minimal_prompt_passes():
    validate(prompt(), LIMITS)


def test_minimal_chat_passes():
    validate(GenerationRequest(messages=[("user", "hi")]), LIMITS)


def test_every_field_at_its_edges_passes():
    validate(
        GenerationRequest(
            messages=[("system", "s"), ("user", "u"), ("assistant", "a"), ("tool", "t")],
            enable_thinking=False,
            max_tokens=LIMITS.max_tokens_limit,
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            min_p=1.0,
            repetition_penalty=1e-3,
            presence_penalty=-2.0,
            frequency_penalty=2.0,
            seed=2**64 - 1,
            stop=["x" * 128] * 8,
            stop_token_ids=[0, 151645],
            ignore_eos=True,
            logprobs=20,
            skip_special_tokens=False,
            request_id="abc",
        ),
        LIMITS,
    )
    validate(prompt(max_tokens=1, top_k=0, min_p=0.0, logprobs=0, seed=0, top_p=1e-6), LIMITS)


# --- prompt and messages --------------------------------------------------------------


def test_neither_prompt_nor_messages():
    rejects(GenerationRequest(), "prompt", "messages")


def test_both_prompt_and_messages():
    rejects(GenerationRequest(prompt="a", messages=[("user", "b")]), "exactly one", "prompt")


def test_empty_prompt():
    rejects(GenerationRequest(prompt=""), "prompt", "empty")


def test_whitespace_prompt_is_not_empty():
    validate(GenerationRequest(prompt=" "), LIMITS)


def test_prompt_too_many_chars():
    limits = Limits(max_context=4096, max_prompt_chars=10)
    validate(GenerationRequest(prompt="x" * 10), limits)
    rejects(GenerationRequest(prompt="x" * 11), "prompt", "11", "10", limits=limits)


def test_chat_content_counts_against_prompt_chars():
    limits = Limits(max_context=4096, max_prompt_chars=10)
    req = GenerationRequest(messages=[("user", "x" * 6), ("user", "y" * 6)])
    rejects(req, "messages", "12", limits=limits)


def test_empty_messages():
    rejects(GenerationRequest(messages=[]), "messages", "empty")


WEATHER_TOOL = '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}'


def test_tools_count_against_prompt_chars():
    """Their JSON is rendered into the prompt, so it is counted before anything is encoded."""
    req = GenerationRequest(messages=[("user", "hi")], tools=[WEATHER_TOOL, WEATHER_TOOL])
    limits = Limits(max_context=4096, max_prompt_chars=2 + 2 * len(WEATHER_TOOL))
    validate(req, limits)
    rejects(req, "messages", str(2 + 2 * len(WEATHER_TOOL)), limits=Limits(max_context=4096,
                                                                          max_prompt_chars=2 * len(WEATHER_TOOL)))


def test_past_tool_calls_count_against_prompt_chars():
    arguments = '{"city": "' + "x" * 50 + '"}'
    req = GenerationRequest(messages=[("user", "hi"), ("assistant", ""), ("tool", "sunny")],
                            message_tool_calls={1: [ToolCall("c1", "get_weather", arguments)]},
                            tool_call_ids={2: "c1"})
    chars = len("hi") + len("sunny") + len("c1") + len("get_weather") + len(arguments) + len("c1")
    validate(req, Limits(max_context=4096, max_prompt_chars=chars))
    rejects(req, "messages", str(chars), limits=Limits(max_context=4096, max_prompt_chars=chars - 1))


@pytest.mark.parametrize("role", ["", "User", "bot", "function"])
def test_unknown_role(role):
    req = GenerationRequest(messages=[("user", "a"), (role, "b")])
    rejects(req, "messages[1].role", repr(role), "system")


def test_too_many_messages():
    limits = Limits(max_context=4096, max_messages=3)
    validate(GenerationRequest(messages=[("user", "a")] * 3), limits)
    rejects(GenerationRequest(messages=[("user", "a")] * 4), "messages", "4", "3", limits=limits)


# --- sampling -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value, expected_range",
    [
        ("temperature", -0.1, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", -1.0, "(0, 1]"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("presence_penalty", -2.5, "[-2, 2]"),
        ("presence_penalty", 2.01, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
    ],
)
def test_float_out_of_range(name, value, expected_range):
    rejects(prompt(**{name: value}), name, expected_range, f"{value:g}")


@pytest.mark.parametrize(
    "name",
    ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"],
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats(name, value):
    rejects(prompt(**{name: value}), name, "finite")


def test_top_k_below_minus_one():
    rejects(prompt(top_k=-2), "top_k", "-1", "-2")


def test_seed_out_of_range():
    rejects(prompt(seed=-1), "seed", "-1")
    rejects(prompt(seed=2**64), "seed")


# --- max_tokens, stops, logprobs ------------------------------------------------------


def test_max_tokens_zero():
    rejects(prompt(max_tokens=0), "max_tokens", ">= 1", "0")


def test_max_tokens_above_limit_names_the_range_this_prompt_leaves():
    limits = Limits(max_context=4096, max_tokens_limit=1000)
    validate(prompt(max_tokens=5000), limits)  # the bound waits for the prompt's length
    assert check_prompt_length(10, 1000, limits) == 1000
    with pytest.raises(InvalidArgument) as info:
        check_prompt_length(10, 1001, limits)
    assert str(info.value) == ("max_tokens must be in [1, 1000] for this prompt of 10 tokens (context 4096 "
                               "tokens, max_tokens limit 1000), got 1001")
    with pytest.raises(InvalidArgument, match=r"in \[1, 4095\] for this prompt of 1 tokens"):
        check_prompt_length(1, 4096, LIMITS)


def test_max_logprobs_is_capped_by_the_worker():
    worker = worker_pb2.GetInfoResponse(max_context=4096, max_logprobs=20)
    assert Limits.for_worker(worker, max_logprobs=50).max_logprobs == 20
    assert Limits.for_worker(worker, max_logprobs=5).max_logprobs == 5
    assert Limits.for_worker(worker).max_logprobs == 20
    rejects(prompt(logprobs=21), "logprobs", "[0, 20]", limits=Limits.for_worker(worker, max_logprobs=50))


def test_gateway_limits_beyond_the_workers_context_are_capped_there(caplog):
    """Known only once the worker answers: capped with a warning, never a failure of every request."""
    worker = worker_pb2.GetInfoResponse(max_context=4096)
    limits = Limits.for_worker(worker, max_prompt_tokens=8000, max_tokens_limit=9000)
    assert (limits.max_prompt_tokens, limits.max_tokens_limit) == (4095, 4096)
    assert "--max-prompt-tokens 8000 is beyond what the worker's context allows; using 4095" in caplog.text
    assert Limits.for_worker(worker, max_prompt_tokens=100).max_prompt_tokens == 100


@pytest.mark.parametrize("request_id", ["", "r-1", "chatcmpl-0123456789abcdef", "a" * 128,
                                        "".join(chr(c) for c in range(0x21, 0x7f))[:128]])
def test_request_ids_within_the_rule_pass(request_id):
    validate(prompt(request_id=request_id), LIMITS)
    logged = caller_request_id(request_id)
    assert logged == request_id if request_id else len(logged) == 32  # none given: a generated one


@pytest.mark.parametrize("request_id, words", [
    ("a" * 129, ["request_id is 129 characters", "at most 128 printable ASCII characters"]),
    ("ok\nINFO forged: line", ["'\\n' at position 2", "without spaces or control characters"]),
    ("two words", ["' ' at position 3"]),
    ("tab\there", ["'\\t' at position 3"]),
    ("nul\x00", ["'\\x00' at position 3"]),
    ("del\x7f", ["'\\x7f' at position 3"]),
    ("café", ["'é' at position 3"]),
])
def test_request_ids_outside_the_rule_are_refused_naming_it(request_id, words):
    message = rejects(prompt(request_id=request_id), *words)
    assert request_id not in message  # the whole id is never repeated, in the reply or the log
    # The log line and echo use a fresh id instead of the bad one.
    fresh = caller_request_id(request_id)
    assert fresh != request_id and len(fresh) == 32 and fresh.isalnum()


def test_too_many_stop_strings():
    rejects(prompt(stop=["a"] * 9), "stop", "9", "8")


def test_empty_stop_string():
    rejects(prompt(stop=["ok", ""]), "stop[1]", "empty")


def test_stop_string_too_long():
    rejects(prompt(stop=["x" * 129]), "stop[0]", "129", "128")


def test_negative_stop_token_id():
    rejects(prompt(stop_token_ids=[3, -1]), "stop_token_ids[1]", "-1")


def test_logprobs_above_limit():
    rejects(prompt(logprobs=21), "logprobs", "20", "21")
    rejects(prompt(logprobs=-1), "logprobs")


# --- check_prompt_length --------------------------------------------------------------

SMALL = Limits(max_context=100)


def test_empty_tokenization():
    with pytest.raises(InvalidArgument, match="empty"):
        check_prompt_length(0, None, SMALL)


def test_prompt_longer_than_allowed():
    with pytest.raises(InvalidArgument, match=r"prompt is 100 tokens; at most 99"):
        check_prompt_length(100, None, SMALL)
    limits = Limits(max_context=100, max_prompt_tokens=50)
    assert check_prompt_length(50, 1, limits) == 1
    with pytest.raises(InvalidArgument, match="at most 50"):
        check_prompt_length(51, 1, limits)


def test_prompt_plus_max_tokens_over_context():
    with pytest.raises(InvalidArgument) as info:
        check_prompt_length(60, 50, SMALL)
    assert str(info.value) == (
        "max_tokens must be in [1, 40] for this prompt of 60 tokens (context 100 tokens, max_tokens limit 100), "
        "got 50"
    )


def test_prompt_plus_max_tokens_exactly_fills_context():
    assert check_prompt_length(60, 40, SMALL) == 40


def test_unset_max_tokens_fills_the_context():
    assert check_prompt_length(60, None, SMALL) == 40
    assert check_prompt_length(99, None, SMALL) == 1


def test_unset_max_tokens_is_capped_by_the_limit():
    limits = Limits(max_context=100, max_tokens_limit=10)
    assert check_prompt_length(60, None, limits) == 10
    assert check_prompt_length(95, None, limits) == 5


# --- from_proto -----------------------------------------------------------------------


def test_from_proto_leaves_unset_optionals_none():
    req = from_proto(gateway_pb2.GenerateRequest(prompt="hi"))
    assert req == GenerationRequest(prompt="hi")
    assert req.skip_special_tokens is True


def test_from_proto_keeps_explicit_zeros():
    msg = gateway_pb2.GenerateRequest(
        prompt="hi",
        temperature=0.0,
        top_k=0,
        seed=0,
        logprobs=0,
        presence_penalty=0.0,
        enable_thinking=False,
        skip_special_tokens=False,
    )
    req = from_proto(msg)
    assert (req.temperature, req.top_k, req.seed, req.logprobs) == (0.0, 0, 0, 0)
    assert req.presence_penalty == 0.0
    assert req.enable_thinking is False
    assert req.skip_special_tokens is False
    assert req.top_p is None and req.max_tokens is None


def test_from_proto_copies_everything():
    msg = gateway_pb2.GenerateRequest(
        messages=[
            gateway_pb2.ChatMessage(role="system", content="be brief"),
            gateway_pb2.ChatMessage(role="user", content="hi"),
        ],
        max_tokens=7,
        top_p=0.5,
        min_p=0.25,
        repetition_penalty=1.5,
        frequency_penalty=-1.0,
        stop=["a", "b"],
        stop_token_ids=[5],
        ignore_eos=True,
        request_id="r1",
    )
    req = from_proto(msg)
    assert req.prompt is None
    assert req.messages == [("system", "be brief"), ("user", "hi")]
    # These values are exact in float32, so they survive the proto's float fields.
    assert (req.max_tokens, req.top_p, req.min_p) == (7, 0.5, 0.25)
    assert (req.repetition_penalty, req.frequency_penalty) == (1.5, -1.0)
    assert (req.stop, req.stop_token_ids) == (["a", "b"], [5])
    assert (req.ignore_eos, req.request_id) == (True, "r1")
    validate(req, LIMITS)


@pytest.mark.parametrize("msg", [gateway_pb2.GenerateRequest(), gateway_pb2.GenerateRequest(messages=[]),
                                 gateway_pb2.GenerateRequest(prompt="", messages=[])])
def test_from_proto_with_neither_prompt_nor_messages_names_both(msg):
    """proto3 cannot tell an empty prompt or messages from an absent one: the message names both fields."""
    message = rejects(from_proto(msg), "neither prompt nor messages", "at least one message")
    assert "prompt is empty" not in message


def test_a_field_is_named_as_the_caller_spelled_it():
    rejects(prompt(logprobs=50, field_names={"logprobs": "top_logprobs"}), "top_logprobs must be in [0, 20], got 50")
    rejects(prompt(max_tokens=0, field_names={"max_tokens": "max_completion_tokens"}), "max_completion_tokens must")
    with pytest.raises(InvalidArgument, match=r"^max_completion_tokens must be in \[1, 4095\]"):
        check_prompt_length(1, 5000, LIMITS, "max_completion_tokens")


def test_the_face_checks_need_no_worker_and_the_vocabulary_waits_for_one():
    for req, words in [(prompt(top_p=2.0), "top_p"), (GenerationRequest(prompt=""), "empty"),
                       (prompt(seed=-1), "seed"), (prompt(logprobs=21), "logprobs"),
                       (GenerationRequest(prompt_token_ids=[-1]), "prompt[0]"), (prompt(logit_bias={-1: 1.0}), "logit_bias")]:
        with pytest.raises(InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")):
            check_request(req, RequestLimits())
    beyond = [GenerationRequest(prompt_token_ids=[5, 4096]), prompt(logit_bias={4096: 1.0})]
    for req in beyond:
        check_request(req, RequestLimits())
        with pytest.raises(InvalidArgument, match="vocabulary"):
            check_for_worker(req, Limits(max_context=4096, vocab_size=4096))


def test_request_limits_take_the_gateway_flags_that_need_no_worker():
    overrides = dict(max_prompt_tokens=100, max_tokens_limit=None, max_stop_strings=2, max_stop_string_chars=5,
                     max_logprobs=3, max_prompt_chars=7)
    limits = RequestLimits.from_overrides(overrides)
    assert (limits.max_stop_strings, limits.max_stop_string_chars, limits.max_logprobs,
            limits.max_prompt_chars) == (2, 5, 3, 7)
    assert not hasattr(limits, "max_prompt_tokens")


def test_from_proto_nan_reaches_validation():
    req = from_proto(gateway_pb2.GenerateRequest(prompt="x", temperature=math.nan))
    rejects(req, "temperature", "finite")


def test_tools_need_a_chat_and_known_choices():
    tool = '{"type": "function", "function": {"name": "f"}}'
    for choice in ("auto", "none"):  # the defaults a plain prompt carries over gRPC and HTTP
        validate(GenerationRequest(prompt="p", tool_choice=choice), LIMITS)
    rejects(GenerationRequest(prompt="p", tools=[tool]), "tools", "messages")
    rejects(GenerationRequest(prompt="p", tool_choice="required"), "tools", "messages")
    validate(GenerationRequest(messages=[("user", "u")], tools=[tool], tool_choice="f"), LIMITS)
    rejects(GenerationRequest(messages=[("user", "u")], tools=[tool], tool_choice="g"), "tool_choice", "'g'")
