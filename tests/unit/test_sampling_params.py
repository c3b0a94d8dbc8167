"""SamplingParams: request overrides over generation_config defaults, and the range checks."""

import math

import pytest

from rpcserver.errors import InvalidArgument
from services.model_worker.config.sampling import SamplingParams

QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}
VOCAB = 151936


def test_unset_fields_take_the_generation_config():
    p = SamplingParams.resolve({}, QWEN3_GENERATION_CONFIG)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 20, 0.95)
    assert (p.min_p, p.repetition_penalty, p.stop_token_ids) == (0.0, 1.0, ())
    assert not p.is_greedy


def test_request_fields_win_over_the_generation_config():
    request = {"temperature": 1.2, "top_k": -1, "seed": 7}
    p = SamplingParams.resolve(request, QWEN3_GENERATION_CONFIG)
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (1.2, -1, 0.95, 7)


def test_none_in_the_request_counts_as_unset():
    p = SamplingParams.resolve({"temperature": None, "top_p": None}, QWEN3_GENERATION_CONFIG)
    assert (p.temperature, p.top_p) == (0.6, 0.95)


def test_without_a_generation_config_the_dataclass_defaults_apply():
    # transformers would fill top_k=50; only values the file holds count here.
    p = SamplingParams.resolve({}, {})
    assert p == SamplingParams()
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 1.0)


def test_do_sample_false_means_greedy_unless_the_request_sets_temperature():
    config = {"do_sample": False, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}
    greedy = SamplingParams.resolve({}, config)
    assert greedy.is_greedy and greedy.temperature == 0.0
    assert greedy.repetition_penalty == 1.05
    sampled = SamplingParams.resolve({"temperature": 0.9}, config)
    assert not sampled.is_greedy and (sampled.temperature, sampled.top_p) == (0.9, 0.8)


def test_a_generation_config_without_do_sample_is_not_greedy():
    assert SamplingParams.resolve({}, {"temperature": 0.7}).temperature == 0.7


def test_generation_config_nulls_and_other_keys_are_ignored():
    config = {"top_k": None, "max_length": 10, "eos_token_id": 3, "temperature": 1}
    p = SamplingParams.resolve({}, config)
    assert p.top_k == -1 and p.max_tokens is None and p.stop_token_ids == ()
    assert p.temperature == 1.0 and isinstance(p.temperature, float)


def test_unknown_request_fields_are_rejected():
    with pytest.raises(InvalidArgument, match="temprature"):
        SamplingParams.resolve({"temprature": 0.5}, {})


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams.resolve({"stop_token_ids": [5, 6]}, {}).stop_token_ids == (5, 6)


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (9e-6, True), (1e-5, False), (0.6, False)]
)
def test_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_defaults_and_qwen3_values_validate():
    SamplingParams().validate(VOCAB)
    SamplingParams.resolve({}, QWEN3_GENERATION_CONFIG).validate(VOCAB)
    SamplingParams(
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=1.0,
        repetition_penalty=0.5,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=2**64 - 1,
        logprobs=20,
        max_tokens=1,
        stop_token_ids=(0, VOCAB - 1),
    ).validate(VOCAB)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be >= 0 .*got -0\.1"),
        ({"temperature": math.nan}, r"temperature must be a finite number, got nan"),
        ({"temperature": math.inf}, r"temperature must be a finite number, got inf"),
        ({"temperature": "hot"}, r"temperature must be a number, got 'hot'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
        ({"top_p": -math.inf}, r"top_p must be a finite number"),
        ({"top_k": -2}, r"top_k must be >= -1 .*got -2"),
        ({"top_k": 2.5}, r"top_k must be an integer, got 2\.5"),
        ({"min_p": -0.01}, r"min_p must be in \[0, 1\], got -0\.01"),
        ({"min_p": 1.01}, r"min_p must be in \[0, 1\], got 1\.01"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 .*got 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2\.5"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\], got -2\.01"),
        ({"frequency_penalty": math.nan}, r"frequency_penalty must be a finite number"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*64 - 1\], got -1"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*64 - 1\], got 18446744073709551616"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\], got -1"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
        (
            {"stop_token_ids": (3, VOCAB)},
            rf"stop_token_ids\[1\] must be in \[0, {VOCAB - 1}\].*got {VOCAB}",
        ),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids\[0\] must be in \[0, .*got -1"),
    ],
)
def test_validate_names_the_field_the_value_and_the_range(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**fields).validate(VOCAB)


def test_max_logprobs_is_configurable():
    SamplingParams(logprobs=50).validate(VOCAB, max_logprobs=64)
    with pytest.raises(InvalidArgument, match=r"logprobs must be in \[0, 5\], got 6"):
        SamplingParams(logprobs=6).validate(VOCAB, max_logprobs=5)
