"""Malformed and extreme requests, generated: each one gets INVALID_ARGUMENT, and normal requests still succeed."""
from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.worker.v1 import worker_pb2

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

bad_floats = st.sampled_from([math.nan, math.inf, -math.inf])
# One malformed field on an otherwise valid request: which field, and how it is wrong.
gateway_mutations = st.one_of(
    st.tuples(st.just("temperature"), st.one_of(bad_floats, st.floats(max_value=-1e-6, allow_nan=False))),
    st.tuples(st.just("top_p"), st.one_of(bad_floats, st.floats(max_value=0.0, allow_nan=False),
                                          st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False))),
    st.tuples(st.just("top_k"), st.integers(min_value=-2**31, max_value=-2)),
    st.tuples(st.just("min_p"), st.one_of(bad_floats, st.floats(min_value=1.0001, allow_infinity=False),
                                          st.floats(max_value=-1e-6, allow_nan=False))),
    st.tuples(st.just("repetition_penalty"), st.one_of(bad_floats, st.floats(max_value=0.0, allow_nan=False))),
    st.tuples(st.just("presence_penalty"), st.one_of(bad_floats, st.floats(min_value=2.0001, allow_infinity=False))),
    st.tuples(st.just("frequency_penalty"), st.one_of(bad_floats, st.floats(max_value=-2.0001, allow_nan=False))),
    st.tuples(st.just("max_tokens"), st.one_of(st.just(0), st.integers(min_value=2000, max_value=2**32 - 1))),
    st.tuples(st.just("logprobs"), st.integers(min_value=21, max_value=2**32 - 1)),
    st.tuples(st.just("stop"), st.one_of(st.lists(st.text(min_size=1, max_size=5), min_size=9, max_size=40),
                                         st.just([""]), st.lists(st.text(min_size=129, max_size=300), min_size=1,
                                                                 max_size=2))),
    st.tuples(st.just("role"), st.text(max_size=12).filter(lambda r: r not in ("system", "user", "assistant", "tool"))),
    st.tuples(st.just("prompt"), st.sampled_from(["", "x" * 1_000_001])),
)


def mutated_request(field: str, value) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(prompt="hello", max_tokens=2)
    if field == "role":
        request.ClearField("prompt")
        request.messages.append(gateway_pb2.ChatMessage(role=value, content="hi"))
    elif field == "stop":
        request.stop.extend(value)
    else:
        setattr(request, field, value)
    return request


def assert_invalid(call) -> str:
    with pytest.raises(grpc.RpcError) as error:
        for _ in call:
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.value.code(), error.value.details())
    return error.value.details()


def assert_normal_request_works(gateway) -> None:
    messages = list(gateway.Generate(gateway_pb2.GenerateRequest(prompt="a normal request", max_tokens=3)))
    assert messages[-1].usage.completion_tokens == 3


@SETTINGS
@given(mutation=gateway_mutations)
def test_malformed_gateway_requests_are_invalid_argument(gateway, mutation):
    assert_invalid(gateway.Generate(mutated_request(*mutation)))
    assert_normal_request_works(gateway)


worker_mutations = st.one_of(
    st.tuples(st.just("prompt_token_ids"), st.one_of(
        st.just([]), st.lists(st.integers(min_value=151936, max_value=2**32 - 1), min_size=1, max_size=4))),
    st.tuples(st.just("temperature"), st.one_of(bad_floats, st.floats(max_value=-1e-6, allow_nan=False))),
    st.tuples(st.just("top_p"), st.one_of(bad_floats, st.floats(min_value=1.0001, allow_infinity=False))),
    st.tuples(st.just("max_tokens"), st.one_of(st.just(0), st.integers(min_value=1024, max_value=2**32 - 1))),
    st.tuples(st.just("stop_token_ids"), st.lists(st.integers(min_value=151936, max_value=2**32 - 1), min_size=1,
                                                  max_size=3)),
    st.tuples(st.just("logprobs"), st.integers(min_value=21, max_value=2**32 - 1)),
)


@SETTINGS
@given(mutation=worker_mutations)
def test_malformed_worker_requests_are_invalid_argument(worker, mutation):
    field, value = mutation
    request = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2)
    if field in ("prompt_token_ids", "stop_token_ids"):
        request.ClearField(field)
        getattr(request, field).extend(value)
    elif field in ("max_tokens", "logprobs"):
        setattr(request, field, value)
    else:
        setattr(request.sampling, field, value)
    assert_invalid(worker.Generate(request))
    assert len(list(worker.Generate(worker_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2)))) == 2


def raw_generate(channel: grpc.Channel, body: bytes):
    method = channel.unary_stream("/vllm_v0.gateway.v1.GatewayService/Generate",
                                  request_serializer=lambda b: b,
                                  response_deserializer=gateway_pb2.GenerateResponse.FromString)
    return method(body, timeout=30)


def test_invalid_utf8_in_a_stop_string_is_invalid_argument(stack, gateway):
    prompt = gateway_pb2.GenerateRequest(prompt="hello", max_tokens=2).SerializeToString()
    bad_stop = bytes([13 << 3 | 2, 2, 0xFF, 0xFE])  # field 13 (stop), length 2, not UTF-8
    with grpc.insecure_channel(stack.gateway.address) as channel:
        details = assert_invalid(raw_generate(channel, prompt + bad_stop))
        assert "UTF-8" in details
        # The same bytes with valid UTF-8 go through.
        good_stop = bytes([13 << 3 | 2, 2]) + "é".encode()
        assert list(raw_generate(channel, prompt + good_stop))[-1].finish_reason
    assert_normal_request_works(gateway)
